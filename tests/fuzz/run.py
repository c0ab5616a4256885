"""Coverage-guided fuzzing of one target with atheris (libFuzzer): `python tests/fuzz/run.py
TARGET -runs=N [libFuzzer flags]`. libFuzzer caps each input's time (-timeout) and the process's
memory (-rss_limit_mb, -malloc_limit_mb): an input past either is reported as a crash."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import atheris

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

with atheris.instrument_imports(include=["kvfence", "llguidance"]):
    import kvfence.pd.pairing  # noqa: F401
    import kvfence.pd.transport.tcp  # noqa: F401
    import kvfence.pd.wire  # noqa: F401
    import kvfence.server.hop  # noqa: F401
    import kvfence.server.structured  # noqa: F401
    import kvfence.server.tools  # noqa: F401
    import kvfence.structured.grammar  # noqa: F401

from targets import run_one, targets  # noqa: E402


def main() -> None:
    name, flags = sys.argv[1], sys.argv[2:]
    target = targets()[name]
    # Kept between runs, so a later run starts from what an earlier one found.
    corpus = Path(tempfile.gettempdir()) / "kvfence-fuzz" / name
    corpus.mkdir(parents=True, exist_ok=True)
    for i, seed in enumerate(target.seeds()):
        (corpus / f"seed-{i}").write_bytes(seed)

    def one_input(data: bytes) -> None:
        run_one(target, data)

    atheris.Setup([sys.argv[0], *flags, str(corpus)], one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
