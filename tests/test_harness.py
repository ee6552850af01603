"""The common multi-rank battery for the collective backend on 1-4 gloo ranks (one spawn)."""

import pytest

from dilated_attention.testing.harness import cases, spawn_battery

WORLD = 4
NAMES = [c.name for p in range(1, WORLD + 1) for c in cases(p)] + [
    f"{check}@P{p}" for p in range(2, WORLD + 1) for check in ("disagreeing-ranks", "one-rank-invalid", "unchecked-calls")
]


@pytest.fixture(scope="module")
def results():
    by_case: dict[str, list] = {}
    for r in spawn_battery(["collective"], WORLD):
        key = r.case if r.case.startswith("P") else f"{r.case}@P{r.world}"
        by_case.setdefault(key, []).append(r)
    return by_case


@pytest.mark.parametrize("name", NAMES)
def test_case_on_every_rank(results, name):
    got = results.get(name, [])
    world = int(name.split("P")[-1].split("-")[0])
    assert sorted(r.rank for r in got) == list(range(world)), f"missing ranks for {name}"
    bad = [f"rank {r.rank}: {r.message or r.errors}" for r in got if not r.ok]
    assert not bad, "\n".join(bad)
