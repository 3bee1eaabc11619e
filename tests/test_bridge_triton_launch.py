"""The direct path's kernel launch without triton's Python layers (:mod:`kvcanary_jax.bridge.
triton_launch`), on stand-ins of triton 3.6's compiled kernel, launcher and C launcher (this
machine has no GPU; the GPU gate launches the real ones): the C launcher gets what triton's own
path gives it, hooks aside, and every case it cannot vouch for goes through triton's runner.
"""

from __future__ import annotations

import types

import pytest

from kvcanary_jax.bridge import triton_launch


class HookChain:  # triton.knobs.HookChain's shape (the module checks the type's name)
    def __init__(self):
        self.calls = []

    def __call__(self, *a):
        for c in self.calls:
            c(*a)


class LazyDict(dict):
    pass


class CLauncher:
    """triton 3.6's generated C launcher: calls a hook only when it is not None."""

    def __init__(self):
        self.launches = []

    def __call__(self, gx, gy, gz, stream, function, coop, pdl, gscratch, pscratch, kmeta,
                 lmeta, enter, leave, *args):
        if enter is not None:
            enter(lmeta)
        self.launches.append((gx, gy, gz, stream, function, coop, pdl, gscratch, pscratch,
                              kmeta, args))
        if leave is not None:
            leave(lmeta)


class CudaLauncher:
    """triton 3.6's launcher object: scratch, then the C launcher."""

    def __init__(self, launch, scratch=0):
        self.launch = launch
        self.global_scratch_size = scratch
        self.profile_scratch_size = 0
        self.launch_cooperative_grid = 0
        self.launch_pdl = 1

    def __call__(self, gx, gy, gz, stream, function, *args):
        g = object() if self.global_scratch_size else None
        self.launch(gx, gy, gz, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    g, None, *args)


class Compiled:
    """triton 3.6's CompiledKernel: ``kernel[grid]`` builds the hooks' metadata, then launches."""

    def __init__(self, rt, launcher):
        self.rt, self._run = rt, launcher
        self.function, self.packed_metadata = 0xF00, (4, 1, 0)
        self.metadata_built = 0

    @property
    def run(self):
        return self._run

    def launch_metadata(self, grid, stream, *args):
        self.metadata_built += 1
        return LazyDict(stream=stream)

    def __getitem__(self, grid):
        def runner(*args, stream=None):
            md = self.launch_metadata(grid, stream, *args)
            self.run(grid[0], grid[1], grid[2], stream, self.function, self.packed_metadata, md,
                     self.rt.launch_enter_hook, self.rt.launch_exit_hook, *args)
        return runner


@pytest.fixture
def rt(monkeypatch):
    rt = types.SimpleNamespace(launch_enter_hook=HookChain(), launch_exit_hook=HookChain())
    monkeypatch.setattr(triton_launch, "_hooks",
                        lambda: (rt, rt.launch_enter_hook, rt.launch_exit_hook))
    monkeypatch.setattr(triton_launch, "_MODE", "direct")
    return rt


GRID = (7, 1, 1)


def _pair(rt, **kw):
    c = CLauncher()
    return c, Compiled(rt, CudaLauncher(c, **kw))


def test_the_c_launcher_gets_what_tritons_path_gives_it(rt):
    c_fast, fast = _pair(rt)
    c_slow, slow = _pair(rt)
    run = triton_launch.runner(fast, GRID, 3)
    for stream, args in ((11, (1, 2, 3)), (12, (4, 5, 6)), (11, (7, 8, 9))):
        run(*args, stream=stream)
        slow[GRID](*args, stream=stream)
    assert c_fast.launches == c_slow.launches and len(c_fast.launches) == 3
    assert c_fast.launches[1] == (7, 1, 1, 12, 0xF00, 0, 1, None, None, (4, 1, 0), (4, 5, 6))
    assert fast.metadata_built == 0  # no metadata for hooks: nothing to call them


def test_an_attached_hook_goes_through_tritons_runner(rt):
    c, k = _pair(rt)
    run = triton_launch.runner(k, GRID, 2)
    seen = []
    rt.launch_enter_hook.calls.append(seen.append)
    run(1, 2, stream=5)
    assert len(seen) == 1 and seen[0] == {"stream": 5} and k.metadata_built == 1
    rt.launch_enter_hook.calls.clear()
    rt.launch_exit_hook = HookChain()  # a new chain object: not the recorded one
    run(3, 4, stream=6)
    assert k.metadata_built == 2
    assert [x[-1] for x in c.launches] == [(1, 2), (3, 4)]


@pytest.mark.parametrize("case", ["scratch", "hook", "switch", "tuple"])
def test_what_it_cannot_vouch_for_is_tritons_runner(rt, monkeypatch, case):
    c, k = _pair(rt, scratch=64 if case == "scratch" else 0)
    if case == "hook":
        rt.launch_exit_hook.calls.append(lambda md: None)
    if case == "switch":
        monkeypatch.setattr(triton_launch, "_MODE", "triton")
    if case == "tuple":  # a launcher that passes the arguments as one tuple (another triton)
        inner = k._run.launch
        k._run.launch = lambda *a: inner(*a[:-1], *a[-1])
        orig = CudaLauncher.__call__

        def call(self, gx, gy, gz, stream, function, *args):
            n = 13 - 5  # the fixed parameters after function
            orig(self, gx, gy, gz, stream, function, *args[:n], tuple(args[n:]))

        monkeypatch.setattr(CudaLauncher, "__call__", call)
    run = triton_launch.runner(k, GRID, 2)
    run(1, 2, stream=5)
    assert c.launches[-1][-1] == (1, 2) and c.launches[-1][3] == 5
    assert k.metadata_built >= 1  # triton's runner built the metadata: its path was taken
