"""Guards: which safety guards are on. Every guard is on in production; a test's twin (through a
fault point, kvfence/faults/) or the model checker's mutation twin turns one off."""

from __future__ import annotations

from dataclasses import dataclass, field

GUARDS = frozenset(
    {
        "admission",  # admit() refuses what does not fit (I1)
        "tag_check",  # page ownership checks on every read and transfer source (I2)
        "dest_check",  # decode writes a transferred page only into its room's grant's pages (I2)
        "count_check",  # decode compares DONE's counts with what it reserved (I3)
        "checksum",  # decode checks page checksums and the read-back digest (I3)
        "deferred_release",  # decode frees an aborted room only after the fence (I4)
        "abort_ack",  # prefill acknowledges an ABORT (I4, liveness)
        "peer_verify",  # PD peers verify each other's certificate and its role (I8)
        "pairing_check",  # prefill and decode compare their pairing facts (I7)
        "credential_tenant",  # the tenant comes from the API key alone (I6)
        "prefix_namespace",  # prefix-cache keys and sealed-page reads carry the namespace (I2)
        "prefix_token_compare",  # a cached page is reused only if its stored tokens match (I2)
        "prefix_digest",  # PD prefill recomputes what decode's cached prefix must hold (I2, I3)
        # A cached page a live room references is never evicted (I4; the model checker's
        # twin: the runtime's references are the prefix cache's refcounts).
        "prefix_pin",
        "router_tenant",  # the router routes a tenant by its own prefixes only (I6)
        "grammar_mask",  # a constrained row samples only tokens its grammar allows
        "fair_share",  # a free running slot goes to the waiting tenant holding the fewest
        "output_bound",  # a stream's undelivered events are bounded per slow reader
        "operator_credential",  # internal endpoints and detailed health need the operator key
        "hop_signature",  # decode dials a prefill only on the router's signed word
        # PD threads reach the pool only through its port: the right thread, grants they hold
        "port_rule",
        # PD decode answers a request that asked for prompt logprobs only with prefill's (I5)
        "prompt_logprobs_whole",
        "lora_digest",  # a LoRA adapter's content digest is part of its prefix-cache namespace
        "lora_pd_digest",  # decode commits a transfer only if prefill applied its adapter
        "warmup_returned",  # the boot warm-up leaves the pool as it found it, or nothing starts
    }
)


@dataclass(frozen=True)
class Guards:
    off: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        unknown = self.off - GUARDS
        if unknown:
            raise ValueError(f"unknown guards {sorted(unknown)}")

    def on(self, guard: str) -> bool:
        return guard not in self.off


ALL_ON = Guards()
