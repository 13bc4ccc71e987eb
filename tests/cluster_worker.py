"""One process of the multi-process serving tests (tests/test_cluster_distributed.py).

    python tests/cluster_worker.py --out_dir DIR [--num_processes 2] [--diverge]

With ``--num_processes`` > 1 it starts that many copies of itself as one cluster of
4-CPU-device processes (:func:`jaxkv.cluster.launcher.launch`), and the engine runs
tensor-parallel over all their devices (one global mesh); alone, on one device. Each
process warms up an engine with a host tier (every step shape), serves three batches
under the lockstep check (the third repeats the first, whose blocks the second pushed
out to host memory) and records their tokens, the host tier's stored and loaded blocks
and the XLA compilations of these calls; ``--diverge`` then serves a second batch
in which process 1 alone has one more prompt token (a different scheduling input), and
records the lockstep error raised. Each process writes ``DIR/process-<id>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

from jaxkv.cluster import distributed
from jaxkv.cluster.launcher import ProcessRole, launch
from jaxkv.cluster.lockstep import LockstepError
from jaxkv.device.mesh import model_mesh
from jaxkv.serving.engine import Engine
from jaxkv.serving.offload_connector import OffloadConfig
from jaxkv.serving.workloads import shared_prefix_prompts

CPU_DEVICES_PER_PROCESS = 4
LOCKSTEP_TIMEOUT_S = 30.0
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def prompts(seed: int) -> list[list[int]]:
    return shared_prefix_prompts(
        num_requests=6, num_prefixes=2, prefix_len=24, suffix_len=(4, 20), vocab_size=512, seed=seed
    )


def serve(args: argparse.Namespace) -> dict:
    """Warm up, serve a batch, and (``--diverge``) a batch process 1 sees differently."""
    multi = jax.process_count() > 1
    engine = Engine.build(
        "tiny-llama-kv8",
        memory_bytes=1 << 20,
        offload=OffloadConfig(host_bytes=2 << 20),
        max_model_len=128,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        mesh=model_mesh(jax.device_count()) if multi else None,
        step_check=distributed.lockstep_check(timeout_s=LOCKSTEP_TIMEOUT_S) if multi else None,
    )
    engine.generate([[0] * 16], 2)  # compiles the prefill and the decode shapes
    transfers, blocks = engine.connector.transfers, engine.manager.config.num_blocks
    engine.runner.cache = transfers.warm_up(engine.runner.cache, blocks)  # as scripts/bench_offload.py
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if event == COMPILE_EVENT else None
    )
    results = [engine.generate(prompts(seed), 6) for seed in (0, 2, 0)]  # the last reloads from host
    record = {
        "tokens": [[list(o.output_token_ids) for o in result.outputs] for result in results],
        "compilations": len(compiles),
        "loaded_blocks": engine.connector.stats.num_loaded_blocks,
        "stored_blocks": engine.connector.stats.num_stored_blocks,
        "device_count": jax.device_count(),
    }
    if args.diverge:
        batch = prompts(seed=1)
        if jax.process_index() == 1:
            batch[0] = [*batch[0], 1]
        try:
            engine.generate(batch, 6)
        except LockstepError as err:
            record["error"] = {"type": type(err).__name__, "step": err.step, "message": str(err)}
    return record


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out_dir", type=Path, required=True)
    parser.add_argument("--num_processes", type=int, default=1)
    parser.add_argument("--diverge", action="store_true")
    args = parser.parse_args()
    role = ProcessRole.from_env()
    if role is None and args.num_processes > 1:
        command = [sys.executable, *sys.argv]
        return launch(command, args.num_processes, cpu_devices_per_process=CPU_DEVICES_PER_PROCESS)
    if role is not None:
        distributed.join(role)
    record = serve(args)
    (args.out_dir / f"process-{jax.process_index()}.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
