"""One flag source (kvfence/args/): `serve`, `preflight` and `up` take the same engine options,
`up` hands every one to its workers unchanged, and preflight plans the pool `serve` would build."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import pytest
from conftest import TINY_MODEL

from kvfence.args.engine import ENGINE_OPTIONS, SIZING_OPTIONS
from kvfence.args.node import NODE_OPTIONS, node_argv
from kvfence.args.option import Option, add_options
from kvfence.args.pd import PD_OPTIONS
from kvfence.args.server import SERVER_OPTIONS
from kvfence.cli import build_parser as build_cli_parser
from kvfence.config import EngineConfig, NodeConfig, PdConfig, ServerConfig
from kvfence.kv.sizing import plan_for_engine
from kvfence.model.config import ModelConfig
from kvfence.tools.preflight import build_parser as build_preflight_parser
from kvfence.tools.preflight import main as preflight_main
from kvfence.tools.up import UpConfig, add_up_args, worker_args

GIB = 2**30


def sample(o: Option) -> tuple[list[str], Any]:
    """A command line giving `o` a value other than its default, and the value it parses to."""
    if o.switch:
        return ([o.negations[0]], False) if o.default else ([o.flag], True)
    if o.nargs is not None:  # several values parse to a list
        return [o.flag, f"x-{o.dest}", "y"], [f"x-{o.dest}", "y"]
    if o.choices:
        value: Any = next(c for c in o.choices if c != o.default)
    elif o.type is int:
        value = (o.default or 0) + 3
    elif o.type is float:
        value = 0.25 if o.default != 0.25 else 0.5
    else:
        value = f"x-{o.dest}"
    return [o.flag, str(value)], value


def serve(argv: list[str]) -> argparse.Namespace:
    return build_cli_parser().parse_args(["serve", *argv])


def up(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_up_args(p)
    return p.parse_args(argv)


def preflight(argv: list[str]) -> argparse.Namespace:
    return build_preflight_parser().parse_args(argv)


def test_every_engine_config_field_has_exactly_one_option_with_its_default() -> None:
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    dests = [o.dest for o in ENGINE_OPTIONS]
    assert sorted(dests) == sorted(fields)  # no field without a flag, no flag twice
    for o in ENGINE_OPTIONS:
        if o.dest != "model":  # required: it has no default
            assert o.default == fields[o.dest].default, o.flag
    names = [n for o in (*ENGINE_OPTIONS, *SERVER_OPTIONS, *PD_OPTIONS) for n in o.names]
    assert len(names) == len(set(names))
    assert set(SIZING_OPTIONS) <= set(ENGINE_OPTIONS)


@pytest.mark.parametrize("option", ENGINE_OPTIONS, ids=lambda o: o.flag)
def test_serve_preflight_and_up_accept_the_same_engine_flag(option: Option) -> None:
    model = ["--model", str(TINY_MODEL)] if option.dest != "model" else []
    parsers = [("serve", serve), ("up", up)]
    if option in SIZING_OPTIONS:
        parsers.append(("preflight", preflight))
    cases = []
    for spelling in option.names:
        argv, value = sample(option)
        argv[0] = spelling
        cases.append((argv, value))
    if option.negations:  # a switch on by default: its name says on, each negation off
        cases = [([n], True) for n in option.names] + [([n], False) for n in option.negations]
    for argv, value in cases:
        for name, parse in parsers:
            got = getattr(parse([*model, *argv]), option.dest)
            assert got == value, f"{name} {argv[0]}: {got!r} != {value!r}"


# Values other than the defaults that build a valid config together (up checks its workers'
# configs before it starts one): a device a native kernel may not run on needs torch kernels.
_VALID = {"device": "cuda:1", "attention_backend": "torch", "linear_backend": "torch"}


def valid_sample(o: Option) -> tuple[list[str], Any]:
    """sample(o), but a value that passes the config's checks."""
    if o.dest in _VALID:
        return [o.flag, _VALID[o.dest]], _VALID[o.dest]
    if o.type is float:
        value = (o.default or 0.25) * 2
        return [o.flag, str(value)], value
    return sample(o)


def test_up_forwards_every_engine_flag_and_serve_parses_back_the_same_values() -> None:
    argv: list[str] = []
    given: dict[str, Any] = {}
    for o in ENGINE_OPTIONS:
        if o.dest == "enable_prefix_caching":  # off, a shared-prefix file is refused
            continue
        if o.dest in ("enable_lora", "lora_modules"):  # LoRA is refused with --tp-size > 1
            continue
        flags, given[o.dest] = valid_sample(o)
        argv += flags
    argv += ["--disaggregation-timeout", "7.5", "--api-key-file", "keys.txt"]
    back = serve(worker_args(UpConfig.from_args(up(argv)), "decode"))
    assert {d: getattr(back, d) for d in given} == given
    assert back.disaggregation_mode == "decode"
    assert (back.disaggregation_timeout, back.api_key_file) == (7.5, "keys.txt")


def test_up_leaves_defaults_to_the_worker_so_both_resolve_them_the_same() -> None:
    ns = up(["--model", str(TINY_MODEL)])
    flags = worker_args(UpConfig.from_args(ns), "prefill")
    assert flags == ["--model", str(TINY_MODEL), "--disaggregation-mode", "prefill"]
    assert EngineConfig.from_args(serve(flags)) == EngineConfig(model=str(TINY_MODEL))


def test_a_command_may_adapt_an_option_but_not_rename_or_invent_one() -> None:
    with pytest.raises(ValueError, match="page_size"):
        add_options(argparse.ArgumentParser(), SERVER_OPTIONS, page_size={"default": 1})
    with pytest.raises(ValueError, match="rename"):
        add_options(argparse.ArgumentParser(), SERVER_OPTIONS, host={"names": ("--bind",)})


def test_preflight_plans_the_pool_serve_would_build(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "--model", str(TINY_MODEL), "--dtype", "float32", "--kv-cache-dtype", "bfloat16",
        "--context-length", "1024", "--page-size", "32", "--mem-fraction-static", "0.25",
        "--chunked-prefill-size", "128", "--max-running-requests", "4",
    ]  # fmt: skip
    cfg = EngineConfig.from_args(serve(argv))
    engine_plan = plan_for_engine(cfg, ModelConfig.from_dir(TINY_MODEL), device_memory=GIB)
    assert preflight_main([*argv, "--device-memory-gib", "1", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    for key in ("pool_tokens", "context_length", "kv_cache_dtype", "page_size", "model_bytes",
                "activation_reserve_bytes", "kv_bytes_per_token"):  # fmt: skip
        assert planned[key] == getattr(engine_plan, key), key


def _config_fields() -> dict[str, Any]:
    return {
        f.name: f.default
        for cls in (EngineConfig, ServerConfig, PdConfig)
        for f in dataclasses.fields(cls)
    }


def test_a_node_flag_is_one_option_and_one_config_field() -> None:
    """Adding a flag means an Option in kvfence/args/ and a field of the config it lands in:
    every NodeConfig field has exactly one option carrying the field's default, every option
    `serve` takes lands in one field, and `serve` takes them all."""
    fields = _config_fields()
    dests = [o.dest for o in NODE_OPTIONS]
    assert sorted(dests) == sorted(fields)
    for o in NODE_OPTIONS:
        if o.dest != "model":
            assert o.default == fields[o.dest], o.flag
    assert NodeConfig.from_args(serve(["--model", "m"])) == NodeConfig(EngineConfig(model="m"))


def test_a_node_config_round_trips_through_its_command_line(tmp_path) -> None:
    """NodeConfig -> node_argv -> `serve`'s parser -> NodeConfig is the identity, with every
    option at a value other than its default (what `up` relies on to write its workers)."""
    # mooncake with --tp-size > 1 is refused, and a shared-prefix file needs the cache on; so is
    # LoRA with --tp-size > 1.
    keep = {"disaggregation_transfer_backend", "enable_prefix_caching", "enable_lora",
            "lora_modules"}
    argv: list[str] = []
    for o in NODE_OPTIONS:
        if o.dest not in keep:
            argv += valid_sample(o)[0]
    config = NodeConfig.from_args(serve(argv))
    for part in (config.engine, config.server, config.pd):
        for f in dataclasses.fields(part):
            if f.name not in keep:
                assert getattr(part, f.name) != f.default, f.name
    assert NodeConfig.from_args(serve(node_argv(config))) == config
    assert node_argv(NodeConfig(EngineConfig(model="m"))) == ["--model", "m"]
