"""layerstream.bench.paged's arguments and chat workload (pure Python; the benchmark itself is run by hand)."""

from __future__ import annotations

import pytest

from layerstream.bench import paged


@pytest.mark.parametrize("flag", ["--repeats", "--rounds"])
def test_repeats_and_rounds_below_one_are_refused(flag, capsys):
    with pytest.raises(SystemExit):
        paged.main([flag, "0"])
    assert f"argument {flag}: must be at least 1, got 0" in capsys.readouterr().err


def test_chat_turn_variants_share_no_block():
    """A turn's repeats must each compute their new tokens: a variant sharing its first block with
    another would find it in the prefix cache and make the cached TTFT look better than it is."""
    for turn in range(1, 9):
        variants = [paged._turn_tokens(turn, v) for v in range(3)]
        assert all(len(t) == paged.TURN_TOKENS for t in variants)
        for a in range(3):
            for b in range(a + 1, 3):
                assert all(x != y for x, y in zip(variants[a], variants[b]))
    # history + REPLY stays block-aligned, so a turn's new tokens start a fresh block
    assert (paged.TURN_TOKENS + len(paged.REPLY)) % 16 == 0
