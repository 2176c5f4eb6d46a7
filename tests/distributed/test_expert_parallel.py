"""Expert parallelism: all-to-all dispatch/combine equals the single-process MoE layer; EP = 2 through the
engine gives the single process's greedy outputs.

Layer test: two gloo ranks (torch.multiprocessing, killed on failure), random inputs, float32:
``atol=1e-5`` against the one-process layer, including redundant slots (replicas on both ranks), a
step with fewer tokens than ranks (a rank with an empty slice) and bfloat16 transport.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch

from tests.model.tiny_moe import save_tiny_moe
from tokenmill import LLM, SamplingParams

E, K, H, I = 8, 2, 32, 16


def _layer(rank: int, ep: int, redundant: int, dtype=torch.float32):
    from tokenmill.model.layers.moe import FusedMoE

    torch.manual_seed(0)
    full_w13, full_w2 = torch.randn(E, 2 * I, H) * 0.2, torch.randn(E, H, I) * 0.2
    router = torch.randn(E, H)
    m = FusedMoE(H, I, E, K, True, redundant, ep, rank).to(dtype)
    with torch.no_grad():
        m.gate.weight.copy_(router)
        for e in range(E):
            m.load_expert_weight(e, "gate_proj", full_w13[e, :I])
            m.load_expert_weight(e, "up_proj", full_w13[e, I:])
            m.load_expert_weight(e, "down_proj", full_w2[e])
    assert not m.missing_expert_weights()
    return m


def _worker(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    from tokenmill.distributed.communicator import Communicator
    from tokenmill.distributed.expert_parallel import ExpertParallel

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.set_num_threads(1)
        comm = Communicator(dist.group.WORLD, 2, rank)
        results = {}
        for redundant, dtype in ((0, torch.float32), (2, torch.float32), (4, torch.bfloat16)):
            m = _layer(rank, 2, redundant, dtype)
            m.ep = ExpertParallel(comm)
            for t in (1, 7, 40):
                x = torch.randn(t, H, generator=torch.Generator().manual_seed(t)).to(dtype)
                with torch.inference_mode():
                    results[(redundant, str(dtype), t)] = m(x).float()
            results[(redundant, str(dtype), "load")] = m.take_expert_load()
        torch.save({"results": results, "a2a_seconds": comm.seconds, "calls": comm.calls},
                   os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_all_to_all_dispatch_matches_one_process(tmp_path):
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    try:
        deadline = time.monotonic() + 240
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "expert-parallel workers timed out"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert all(r["calls"] > 0 and r["a2a_seconds"] > 0 for r in ranks)
    for redundant, dtype in ((0, torch.float32), (2, torch.float32), (4, torch.bfloat16)):
        ref = _layer(0, 1, 0, dtype)           # one process, no replicas
        for t in (1, 7, 40):
            x = torch.randn(t, H, generator=torch.Generator().manual_seed(t)).to(dtype)
            with torch.inference_mode():
                want = ref(x).float()
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            for r in ranks:        # every rank ends with the whole (replicated) output
                torch.testing.assert_close(r["results"][(redundant, str(dtype), t)], want, atol=tol, rtol=tol)
        want_load = ref.take_expert_load()                       # [E] over all three steps
        got = ranks[0]["results"][(redundant, str(dtype), "load")] + ranks[1]["results"][(redundant, str(dtype), "load")]
        assert got.shape == (E + redundant,) and int(got.sum()) == (1 + 7 + 40) * K
        folded = got[:E].clone()
        folded[:redundant] += got[E:]                           # slot E + j replicates expert j
        assert torch.equal(folded, want_load), (redundant, got, want_load)


ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=32, max_num_batched_tokens=16, max_num_seqs=4,
              enable_prefix_caching=True, max_model_len=128)
PROMPTS = [list(range(10, 26)) + [30, 31], list(range(40, 69)), [5, 6, 7], list(range(60, 80))]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)


def _run(llm):
    outs = llm.generate(PROMPTS, PARAMS)
    return [o.outputs[0].token_ids for o in outs], [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """family -> (checkpoint folder, greedy tokens, logprobs) of the one-process engine, computed once."""
    cache = {}

    def get(family):
        if family not in cache:
            folder = save_tiny_moe(tmp_path_factory.mktemp(family), family, seed=3)
            with LLM(folder, **ENGINE) as llm:
                cache[family] = (folder, *_run(llm))
        return cache[family]
    return get


@pytest.mark.parametrize("family,expert_parallel", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True)])
def test_engine_ep2_matches_one_process(one_process, family, expert_parallel):
    """tp=2 with --enable-expert-parallel (experts 0-3 on rank 0, 4-7 on rank 1) and tp=2 with every
    expert's columns split give the one-process greedy tokens (logprobs within 1e-4)."""
    folder, want_toks, want_lps = one_process(family)
    llm = LLM(folder, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ENGINE)
    try:
        ex = llm.engine_core.executor
        lines = [i.layout for i in ex.worker_infos]
        if expert_parallel:
            assert "experts per rank 4 (physical slots 0-3 of 8, expert-parallel rank 0/2), redundant experts 0" \
                in lines[0]
            assert "physical slots 4-7 of 8, expert-parallel rank 1/2" in lines[1]
        else:
            assert "experts per rank 8 (physical slots 0-7 of 8, expert cols 0-15)" in lines[0]
        toks, lps = _run(llm)
        assert toks == want_toks
        for got, want in zip(lps, want_lps):
            assert got == pytest.approx(want, abs=1e-4)
        assert all(s.comm > 0 for s in ex.last_step_stats)
    finally:
        llm.shutdown()


def _stuck_peer_worker(rank: int, port: int, out_dir: str) -> None:
    """Rank 0 enters the data-parallel cores' per-step sync; rank 1 never does (a stuck peer)."""
    from tokenmill.distributed.expert_parallel import StepSync
    from tokenmill.distributed.parallel_state import init_data_parallel_ep

    ctx = init_data_parallel_ep(rank, 2, f"tcp://127.0.0.1:{port}", timeout_s=3.0)
    done = os.path.join(out_dir, "rank0.txt")
    if rank == 0:
        t0 = time.monotonic()
        try:
            StepSync(ctx.dp).sync(True, 0)
            result = "returned"
        except RuntimeError as e:
            result = f"raised {time.monotonic() - t0:.2f} {e}"
        with open(done + ".tmp", "w") as f:
            f.write(result)
        os.replace(done + ".tmp", done)
    else:
        deadline = time.monotonic() + 120
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.1)
    os._exit(0)         # the group is broken: skip its teardown


def test_sub_groups_time_out_on_a_stuck_peer(tmp_path):
    """Every sub-group gets the collective timeout (``TOKENMILL_DIST_TIMEOUT``): ``new_group()`` without one
    falls back to torch's default (30 min for gloo), and an engine core waiting in the per-step sync for a
    stopped peer hung instead of failing its requests (the SIGSTOP test of test_dp_expert_parallel.py)."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_stuck_peer_worker, args=(_free_port(), str(tmp_path)), nprocs=2, join=False,
                             start_method="spawn")
    try:
        deadline = time.monotonic() + 180
        while not ctx.join(timeout=1):
            assert time.monotonic() < deadline, "workers did not finish"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join(5)
    result = (tmp_path / "rank0.txt").read_text()
    assert result.startswith("raised"), result
    assert 2.5 < float(result.split()[1]) < 60, result     # the 3 s timeout, not torch's 30 min
