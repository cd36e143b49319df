"""The KV disk tier (engine/kv_disk.py): blocks found again by their hashes after a restart, a damaged file or
another model's file is a miss (never wrong KV), the size cap, and through the real engine (tiny fp32 Llama):
a prompt reused after a restart gives the tokens and logprobs recomputing it gives."""

from __future__ import annotations

import os

import pytest

from engine.kv_disk import KVDiskTier
from engine.llm import LLM
from tests.support.batching import MAX_LEN, assert_same, drive, greedy

IDENTITY = {"model": "m", "kv": "int8"}
NBYTES = 1000


def _payload(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(NBYTES))


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def _tier(folder, capacity=1 << 20, identity=IDENTITY) -> KVDiskTier:
    return KVDiskTier(folder, capacity, identity, NBYTES)


def test_blocks_written_are_found_again_after_a_restart(tmp_path):
    tier = _tier(tmp_path)
    for i in range(3):
        tier.put(_key(i), _payload(i))
    tier.close()
    again = _tier(tmp_path)
    try:
        assert again.load([_key(0), _key(1), _key(2), _key(9)]) == 3  # stops at the first miss
        assert again.take(_key(1)) == _payload(1) and again.take(_key(1)) is None  # taken once
        assert again.stats.blocks_read == 3 and again.stats.bad_files == 0
    finally:
        again.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_damaged_file_is_a_miss_and_is_removed(tmp_path, damage):
    tier = _tier(tmp_path)
    tier.put(_key(0), _payload(0))
    tier.put(_key(1), _payload(1))
    tier.close()
    path = next(p for p in tier.folder.iterdir() if p.stem == _key(1).hex())
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[-5] ^= 0x40
    elif damage == "truncate":
        data = data[:-1]
    else:
        data = b""
    path.write_bytes(bytes(data))
    again = _tier(tmp_path)
    try:
        assert again.load([_key(0), _key(1)]) == 1  # the good block before it still counts
        assert again.stats.bad_files == 1 and not path.exists() and not again.contains(_key(1))
    finally:
        again.close()


def test_another_models_files_are_never_read(tmp_path):
    tier = _tier(tmp_path)
    tier.put(_key(0), _payload(0))
    tier.close()
    other = _tier(tmp_path, identity={"model": "other", "kv": "int8"})
    try:
        assert other.folder != tier.folder and other.load([_key(0)]) == 0
    finally:
        other.close()
    # A file of the other identity copied into this one's folder: its header says so.
    src = next(tier.folder.iterdir())
    mine = _tier(tmp_path, identity={"model": "third"})
    try:
        (mine.folder / src.name).write_bytes(src.read_bytes())
        mine._index[_key(0)] = None  # as a restart's listing would find it
        assert mine.load([_key(0)]) == 0 and mine.stats.bad_files == 1
    finally:
        mine.close()


def test_the_size_cap_evicts_least_recently_used_files(tmp_path):
    tier = _tier(tmp_path, capacity=3 * (NBYTES + 84))
    try:
        assert tier.capacity_blocks == 3
        for i in range(3):
            tier.put(_key(i), _payload(i))
        assert tier.load([_key(0)]) == 1  # key 0 used: key 1 is now the least recent
        tier.take(_key(0))
        tier.put(_key(3), _payload(3))
        assert [tier.contains(_key(i)) for i in range(4)] == [True, False, True, True]
    finally:
        tier.close()
    assert sorted(p.stem for p in tier.folder.iterdir()) == sorted(_key(i).hex() for i in (0, 2, 3))


def test_bad_limits_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="capacity_bytes > 0"):
        KVDiskTier(tmp_path, 0, IDENTITY, NBYTES)


PROMPT = [(i * 29 + 3) % 500 + 6 for i in range(70)]  # 4 full blocks and 6 tokens


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_a_prompt_reused_after_a_restart_equals_recomputing_it(llama_dir, tmp_path, kv):
    def engine(disk: bool):
        return LLM(str(llama_dir), kv_cache_dtype=kv, max_model_len=MAX_LEN, max_num_seqs=2,
                   kv_disk_bytes="64MiB" if disk else None, kv_disk_dir=str(tmp_path))

    recompute = engine(disk=False)
    try:
        want = drive(recompute.engine, {0: [("r", PROMPT, greedy(8))]})["r"]
    finally:
        recompute.close()
    first = engine(disk=True)
    try:
        assert_same(drive(first.engine, {0: [("r", PROMPT, greedy(8))]})["r"], want)
        assert first.telemetry().kv.blocks_spilled >= 4
    finally:
        first.close()  # a restart: only the files remain
    files = list(tmp_path.rglob("*.kvb"))
    assert len(files) >= 4
    second = engine(disk=True)
    try:
        assert_same(drive(second.engine, {0: [("r", PROMPT, greedy(8))]})["r"], want)
        kv_t = second.telemetry().kv
        assert kv_t.disk_hit_tokens == 64 and kv_t.hit_tokens == 64
    finally:
        second.close()
    # Every file damaged: the next restart recomputes and still answers the same.
    for f in tmp_path.rglob("*.kvb"):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 1
        f.write_bytes(bytes(data))
    third = engine(disk=True)
    try:
        assert_same(drive(third.engine, {0: [("r", PROMPT, greedy(8))]})["r"], want)
        assert third.telemetry().kv.disk_hit_tokens == 0
    finally:
        third.close()


def test_the_disk_tier_keeps_its_files_per_model_identity(llama_dir, model_dirs, tmp_path):
    for folder in (llama_dir, model_dirs["qwen2"]):
        llm = LLM(str(folder), max_model_len=MAX_LEN, max_num_seqs=1, kv_disk_bytes="8MiB", kv_disk_dir=str(tmp_path))
        try:
            drive(llm.engine, {0: [("r", PROMPT, greedy(2))]})
        finally:
            llm.close()
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2
    assert not any(os.fspath(p).endswith(".tmp") for p in tmp_path.rglob("*"))
