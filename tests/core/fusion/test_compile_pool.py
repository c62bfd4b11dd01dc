"""The compile pool: longest kernels first, each compiled kernel readied (launcher, binary) by its own worker."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from worldfoundry.core.fusion import compile_pool
from worldfoundry.core.fusion.triton_support import TRITON_AVAILABLE


class FakeLauncher:
    def __init__(self, name: str, source: str, order: list[str]) -> None:
        self.name = name
        self.fn = SimpleNamespace(src=source)
        self.order = order

    def warmup(self, args: tuple[Any, ...]) -> None:
        self.order.append(self.name)


@pytest.mark.skipif(not TRITON_AVAILABLE, reason="needs triton (AsyncCompileMode)")
def test_the_longest_kernel_sources_are_submitted_first() -> None:
    order: list[str] = []
    jobs = [(FakeLauncher("short", "x" * 10, order), ()), (FakeLauncher("long", "x" * 1000, order), ()),
            (FakeLauncher("middle", "x" * 100, order), ())]
    compile_pool.compile_concurrently(jobs, workers=2)
    assert order == ["long", "middle", "short"]


def test_each_compiled_kernel_is_readied_by_the_worker_that_compiled_it() -> None:
    class Kernel:
        readied_by: list[str] = []

        @property
        def run(self) -> str:
            import threading

            Kernel.readied_by.append(threading.current_thread().name)
            return "launcher"

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile-test") as pool:
        executor = compile_pool._CompileAndLoad(pool)
        kernel = executor.submit(Kernel).result(timeout=30)
    assert isinstance(kernel, Kernel)
    assert len(Kernel.readied_by) == 1 and Kernel.readied_by[0].startswith("compile-test")


def test_a_kernel_that_cannot_be_readied_is_still_returned(caplog: pytest.LogCaptureFixture) -> None:
    class Broken:
        @property
        def run(self) -> str:
            raise RuntimeError("no launcher")

    with ThreadPoolExecutor(max_workers=1) as pool, caplog.at_level("DEBUG", logger=compile_pool.__name__):
        kernel = compile_pool._CompileAndLoad(pool).submit(Broken).result(timeout=30)
    assert isinstance(kernel, Broken)  # the first launch readies it again and raises the real error
    assert any("no launcher" in r.getMessage() for r in caplog.records)
