"""The direct path's kernel launch through CUDA's driver API (``bridge/cuda_launch.py``), on the
CPU: libcuda stood in for by a recorder that reads the parameter block as ``cuLaunchKernel``
would. What the launch must get right: each pointer in its parameter's place and triton's
scratch pointers null, the grid, block and shared memory of the compiled kernel, the caller's
stream, a context made current on a thread that has none, two threads never mixing their
pointers, and triton's launcher wherever this one cannot run (the reason said). On a GPU the
same launch runs in ``tests/test_bridge_gpu.py``, byte-equal to triton's launcher.
"""

from __future__ import annotations

import ctypes
import threading
import types

import pytest

from kvcanary_jax.bridge import cuda_launch as cl
from kvcanary_jax.bridge.dlpack import BridgeError


class _Compiled:
    """Stands in for triton's compiled kernel, its handles loaded."""

    def __init__(self, **meta):
        self.function = 0xF00
        self.metadata = types.SimpleNamespace(**{
            "num_warps": 4, "shared": 1024, "num_ctas": 1, "global_scratch_size": 0,
            "profile_scratch_size": 0, "launch_cooperative_grid": False, "launch_pdl": False,
            **meta})
        self.triton_calls = []

    def __getitem__(self, grid):
        def run(*args, stream):
            self.triton_calls.append((grid, args, stream))
        return run


class _Driver:
    """Stands in for libcuda: records each launch with the pointers its table points at."""

    def __init__(self, num_params=5, rcs=()):
        self.launches, self.made_current = [], []
        self._num_params, self._rcs = num_params, list(rcs)
        self.param_info = object()  # present: CUDA 12.4 or newer

    def launch(self, fn, gx, gy, gz, bx, by, bz, shared, stream, table, extra):
        n = len(table)
        values = [ctypes.cast(table[i], ctypes.POINTER(ctypes.c_uint64))[0] for i in range(n)]
        self.launches.append((fn.value, (gx, gy, gz), (bx, by, bz), shared, stream, values,
                              extra))
        return self._rcs.pop(0) if self._rcs else 0

    def num_params(self, function):
        return self._num_params

    def name(self, rc):
        return {201: "CUDA_ERROR_INVALID_CONTEXT", 700: "CUDA_ERROR_ILLEGAL_ADDRESS"}[rc]

    def make_current(self, ordinal):
        self.made_current.append(ordinal)


@pytest.fixture
def driver(monkeypatch):
    d = _Driver()
    monkeypatch.setattr(cl, "_DRIVER", [d])
    monkeypatch.setitem(cl._CHOICE, "launch", "driver")
    return d


def test_a_launch_hands_each_pointer_in_its_place_and_the_scratch_null(driver):
    k = _Compiled()
    run, reason = cl.runner(k, (7, 1, 1), device=0, num_args=3)
    assert reason == ""
    run(0x1000, 0x2040, 0x30, stream=99)
    run(0x5000, 0x6000, 0x7000, stream=0)
    (fn, grid, block, shared, stream, values, extra), second = driver.launches
    assert (fn, grid, block, shared, stream, extra) == (0xF00, (7, 1, 1), (128, 1, 1), 1024, 99,
                                                        None)
    assert values == [0x1000, 0x2040, 0x30, 0, 0]  # triton's global and profile scratch: null
    assert second[4] == 0 and second[5][:3] == [0x5000, 0x6000, 0x7000]
    assert k.triton_calls == []


def test_a_thread_without_a_current_context_gets_the_devices_and_the_launch_retried(driver):
    driver._rcs = [201]  # CUDA_ERROR_INVALID_CONTEXT, then success
    run, _ = cl.runner(_Compiled(), (1, 1, 1), device=3, num_args=3)
    run(1, 2, 3, stream=5)
    assert driver.made_current == [3]
    assert [v[5][:3] for v in driver.launches] == [[1, 2, 3], [1, 2, 3]]


def test_a_failed_launch_raises_with_the_drivers_name_of_the_error(driver):
    driver._rcs = [700]
    run, _ = cl.runner(_Compiled(), (1, 1, 1), device=0, num_args=3)
    with pytest.raises(BridgeError, match="cuLaunchKernel failed .CUDA_ERROR_ILLEGAL_ADDRESS"):
        run(1, 2, 3, stream=5)


def test_two_threads_never_mix_their_pointers(driver):
    run, _ = cl.runner(_Compiled(), (1, 1, 1), device=0, num_args=3)

    def launches(base):
        for i in range(2000):
            run(base + i, base + i, base + i, stream=base)

    threads = [threading.Thread(target=launches, args=(b,)) for b in (1 << 20, 1 << 40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(driver.launches) == 4000
    for *_, stream, values, _extra in driver.launches:
        assert values[0] == values[1] == values[2] and stream <= values[0] < stream + 2000


def test_a_launch_hook_sends_the_call_through_tritons_launcher(driver, monkeypatch):
    knobs = pytest.importorskip("triton").knobs
    k = _Compiled()
    run, _ = cl.runner(k, (2, 1, 1), device=0, num_args=3)
    run(1, 2, 3, stream=4)  # triton's hook chains are empty: nothing to call
    assert len(driver.launches) == 1 and k.triton_calls == []
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    run(1, 2, 3, stream=4)
    assert len(driver.launches) == 1 and k.triton_calls == [((2, 1, 1), (1, 2, 3), 4)]
    if hasattr(knobs, "HookChain"):  # a chain holding a hook (proton adds its own this way)
        chain = knobs.HookChain()
        chain.add(lambda *a: None)
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", knobs.HookChain())
        monkeypatch.setattr(knobs.runtime, "launch_exit_hook", chain)
        run(5, 6, 7, stream=4)
        assert len(driver.launches) == 1 and k.triton_calls[-1] == ((2, 1, 1), (5, 6, 7), 4)


@pytest.mark.parametrize("meta, params, why", [
    (dict(global_scratch_size=64), 5, "global_scratch_size"),
    (dict(profile_scratch_size=64), 5, "profile_scratch_size"),
    (dict(launch_cooperative_grid=True), 5, "launch_cooperative_grid"),
    (dict(launch_pdl=True), 5, "launch_pdl"),
    (dict(num_ctas=2), 5, "clusters"),
    ({}, 6, "takes 6 parameters where 3 pointers"),
    ({}, None, "takes None parameters"),
])
def test_kernels_this_launch_cannot_run_keep_tritons_launcher(driver, meta, params, why):
    driver._num_params = params
    k = _Compiled(**meta)
    run, reason = cl.runner(k, (1, 1, 1), device=0, num_args=3)
    assert why in reason
    run(1, 2, 3, stream=8)
    assert driver.launches == [] and k.triton_calls == [((1, 1, 1), (1, 2, 3), 8)]


def test_a_kernel_with_no_scratch_parameters_takes_the_launch(driver):
    # Older triton appends no scratch pointers: the two nulls past the kernel's last parameter
    # are never read (cuLaunchKernel reads as many as the kernel declares).
    driver._num_params = 3
    assert cl.runner(_Compiled(), (1, 1, 1), device=0, num_args=3)[1] == ""


def test_without_the_drivers_parameter_list_or_libcuda_triton_launches(monkeypatch):
    monkeypatch.setitem(cl._CHOICE, "launch", "driver")
    d = _Driver()
    d.param_info = None
    monkeypatch.setattr(cl, "_DRIVER", [d])
    assert "cuFuncGetParamInfo" in cl.why_not(_Compiled(), 3)
    monkeypatch.setattr(cl, "_DRIVER", ["libcuda's launch API is not loadable (no libcuda)"])
    assert "not loadable" in cl.why_not(_Compiled(), 3)


def test_set_launch_takes_the_two_words_in_any_case_and_refuses_the_rest(monkeypatch):
    monkeypatch.setitem(cl._CHOICE, "launch", "driver")
    cl.set_launch(" Triton ")
    assert cl.launch_choice() == "triton"
    assert cl.why_not(_Compiled(), 3) == "KVCANARY_BRIDGE_LAUNCH=triton"
    for bad in ("cuda", "", None, True):
        with pytest.raises(ValueError, match="set_launch=.* must be one of driver, triton"):
            cl.set_launch(bad)
        assert cl.launch_choice() == "triton"  # a refused value changes nothing
    cl.set_launch("DRIVER")
    assert cl.launch_choice() == "driver"


def test_the_environment_variable_is_read_with_the_same_words(monkeypatch):
    import importlib

    monkeypatch.setenv("KVCANARY_BRIDGE_LAUNCH", "tritn")
    with pytest.raises(ValueError, match="KVCANARY_BRIDGE_LAUNCH='tritn' must be one of"):
        importlib.reload(cl)
    monkeypatch.setenv("KVCANARY_BRIDGE_LAUNCH", "TRITON")
    importlib.reload(cl)
    assert cl.launch_choice() == "triton"
    monkeypatch.delenv("KVCANARY_BRIDGE_LAUNCH")
    importlib.reload(cl)
    assert cl.launch_choice() == "driver"
