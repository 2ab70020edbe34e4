"""The simulated fleet's command-line arguments build its config. The fleet against a real nats-server:
tests/integration/test_sim_fleet.py."""

from __future__ import annotations

import argparse

from workers_shim.sim.cli import add_sim_arguments, build_config


def test_cli_arguments_build_a_config() -> None:
    parser = argparse.ArgumentParser()
    add_sim_arguments(parser)
    args = parser.parse_args(
        ["--workers", "3", "--profile", "llama3-70b-8xa800", "--block-size", "512", "--cpu-blocks", "100"]
    )
    cfg = build_config(args)
    assert args.workers == 3 and cfg.block_size == 512 and cfg.cpu_blocks == 100
    assert cfg.gpu_blocks == 1_205_000 // 512 and cfg.time.name == "llama3-70b-8xa800"
    args = parser.parse_args(["--gpu-blocks", "1000", "--max-batched-tokens", "2048"])
    cfg = build_config(args)
    assert cfg.gpu_blocks == 1000 and cfg.max_batched_tokens == 2048 and cfg.block_size == 16
