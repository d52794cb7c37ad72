"""hubsoup.linalg's job runner (independent LAPACK calls side by side) and its conjugate-gradient solve."""

from __future__ import annotations

import threading

import pytest
import torch

from hubsoup.linalg import Job, cg_solve, run_jobs


def test_jobs_run_after_what_they_wait_for_and_return_in_order():
    order: list[int] = []
    lock = threading.Lock()

    def step(i: int):
        def fn():
            with lock:
                order.append(i)
            return i * 10
        return fn

    jobs = [Job(step(0)), Job(step(1)), Job(step(2), after=(0,)), Job(step(3), after=(1, 2)), Job(step(4), after=(3,))]
    for threads in (1, 2, 3):
        order.clear()
        assert run_jobs(jobs, threads) == [0, 10, 20, 30, 40]
        assert order.index(2) > order.index(0) and order.index(3) > max(order.index(1), order.index(2))
        assert order[-1] == 4


def test_each_job_runs_with_torch_on_one_thread():
    seen = run_jobs([Job(torch.get_num_threads) for _ in range(4)], threads=2)
    assert seen == [1, 1, 1, 1]
    assert run_jobs([Job(torch.get_num_threads)], threads=1) == [1]


def test_a_failing_job_raises_once_the_others_are_done():
    done = threading.Event()

    def slow():
        done.wait(0.5)
        return "slow"

    def bad():
        raise ValueError("job failed")

    with pytest.raises(ValueError, match="job failed"):
        run_jobs([Job(slow), Job(bad), Job(lambda: "never", after=(1,))], threads=2)


def test_a_job_order_that_cannot_run_is_refused():
    with pytest.raises(ValueError, match="never runs"):
        run_jobs([Job(lambda: 1, after=(1,)), Job(lambda: 2, after=(0,))], threads=2)


def _spd(n: int, cond: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    Q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=g))
    w = torch.logspace(0, torch.log10(torch.tensor(cond)).item(), n, dtype=torch.float64)
    return (Q * w) @ Q.T


@pytest.mark.parametrize("cond", [1.05, 3.0, 50.0])
def test_cg_solves_to_the_direct_solution_and_estimates_kappa(cond):
    G = _spd(200, cond, 1)
    b = torch.randn(200, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x, info = cg_solve(G, b, max_iter=500)
    assert info["converged"] and info["residual"] <= 1e-13
    torch.testing.assert_close(x, torch.linalg.solve(G, b), rtol=0, atol=1e-11 * float(x.abs().max()))
    assert cond / 1.5 <= info["kappa"] <= cond * 1.0001  # a lower bound that reaches κ


def test_cg_with_a_ridge_and_its_limits():
    G = _spd(100, 1000.0, 3)
    b = torch.ones(100, dtype=torch.float64)
    x, info = cg_solve(G, b, ridge=0.5, max_iter=500)
    assert info["converged"]
    torch.testing.assert_close(x, torch.linalg.solve(G + 0.5 * torch.eye(100, dtype=torch.float64), b))
    _, info = cg_solve(G, b, max_iter=5)  # too few iterations for κ = 1000: not converged, the caller solves directly
    assert not info["converged"]
    x, info = cg_solve(G, torch.zeros(100, dtype=torch.float64))
    assert info["converged"] and not x.any()
