"""The real-model corpus cache: built once per machine, never seen half-built, safe to race."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.fixtures.real_models import COVERING_VARIANTS, Variant

BUILDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from tests.fixtures.real_models import cached_build

    log = Path(sys.argv[1])

    def build(tmp: Path) -> None:
        with log.open("a") as f:
            f.write("built\\n")
        (tmp / "half").write_text("x")
        time.sleep(1.0)  # the other process arrives while this one is building
        (tmp / "done").write_text("y")

    out = cached_build("race-key", build)
    assert (out / "done").read_text() == "y", "saw a half-built directory"
    print(out)
    """
)


def test_two_processes_building_one_entry_build_it_once_and_see_it_whole(tmp_path: Path) -> None:
    env = {**os.environ, "MODELPREP_CACHE_HOME": str(tmp_path / "cache")}
    log = tmp_path / "builds.log"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", BUILDER, str(log)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert log.read_text() == "built\n"
    (target,) = {o.strip() for o, _ in outs}
    root = Path(target).parent
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) == ["race-key"]


def test_covering_variants_hit_every_value_of_every_dimension() -> None:
    for field, values in (
        ("tie", {"input", "output", "both"}),
        ("config_keys", {"v4", "v5"}),
        ("dtype", {"float32", "float16", "bfloat16"}),
        ("layout", {"safetensors", "safetensors-sharded", "bin-sharded"}),
    ):
        assert {getattr(v, field) for v in COVERING_VARIANTS} == values, field
    assert len({v.label() for v in COVERING_VARIANTS}) == len(COVERING_VARIANTS)
    assert Variant().label() == "input-v5-bfloat16-safetensors"
