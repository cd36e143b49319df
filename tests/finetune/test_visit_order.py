"""The weights' visit order: a training step's blocks stream forward, then backward in reverse, each
prefetched in that order; anything else is refused."""

import pytest

from engine.finetune import LoRATuner, TrainConfig
from tests.support.finetune import random_examples
from tests.support.finetune import training_budget


def test_blocks_stream_forward_then_in_reverse(llama_dir):
    config = TrainConfig(max_length=32, batch_tokens=64)
    budget = training_budget(llama_dir, config)
    with LoRATuner(str(llama_dir), config, dtype="float32",
                   max_device_memory=budget) as tuner:
        weights, streamed = tuner.base.weights, tuner.plan.streamed_blocks
        assert len(streamed) == tuner.cfg.num_layers - 1
        before = weights.stream_stats.blocks_streamed
        tuner.step([random_examples(2, 512, seed=1)])
        tuner.step([random_examples(2, 512, seed=2)])
        assert weights.stream_stats.blocks_streamed - before == 2 * 2 * len(streamed)  # twice per step
        # The cycle is forward then backward: a second forward pass right away is out of order.
        for i in range(tuner.cfg.num_layers):
            weights.acquire(i)
            weights.release(i)
        with pytest.raises(RuntimeError, match="out of order"):
            weights.acquire(0 if 0 in streamed else streamed[0])
        weights.reset()
        tuner.step([random_examples(2, 512, seed=3)])  # after a reset the cycle starts again


def test_an_order_missing_a_streamed_block_is_refused(llama_dir):
    config = TrainConfig(max_length=32, batch_tokens=64)
    budget = training_budget(llama_dir, config)
    with LoRATuner(str(llama_dir), config, dtype="float32",
                   max_device_memory=budget) as tuner:
        with pytest.raises(ValueError, match="must visit every streamed block"):
            tuner.base.weights.set_visit_order([0, 1])


def test_training_takes_its_share_of_the_budget_first(llama_dir):
    from engine.finetune import training_footprint

    config = TrainConfig(max_length=32, batch_tokens=64)
    need = training_footprint(str(llama_dir), config, dtype="float32")
    assert need.backward_bytes > 0 and need.device_bytes == 2 * need.adapter_bytes + need.backward_bytes
    budget = training_budget(llama_dir, config)
    with LoRATuner(str(llama_dir), config, dtype="float32", max_device_memory=budget) as tuner:
        assert tuner.plan.budget == budget - need.device_bytes  # the base was planned in what is left
    with pytest.raises(ValueError, match="cannot hold training's working set"):
        LoRATuner(str(llama_dir), config, dtype="float32", max_device_memory=need.device_bytes - 1)
