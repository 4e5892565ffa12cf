"""The SM clock and board power while a benchmark times a call (NVML through ctypes: the driver's library, no
Python package), so that a record says at what clock each time was taken. A thread samples every `period` seconds;
`Sampler.summary()` gives the medians. Without NVML (no driver, a CPU machine) every call is a no-op and the summary
is None. The device index is NVML's: the CUDA device's where CUDA_VISIBLE_DEVICES is unset (the benchmark
machines' case).
"""
import ctypes
import statistics
import threading

_NVML_CLOCK_SM = 1  # nvmlClockType_t (NVML_CLOCK_GRAPHICS 0, NVML_CLOCK_SM 1): the clock the kernels run at
_lib = None
_tried = False


def _nvml():
    """The initialised NVML library, or None."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            return None
        _lib = lib
    except (OSError, AttributeError):
        _lib = None
    return _lib


def _handle(index: int):
    lib = _nvml()
    if lib is None:
        return None
    h = ctypes.c_void_p()
    return h if lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(h)) == 0 else None


def sample(index: int = 0):
    """(SM clock in MHz, board power in W) now, or None."""
    h = _handle(index)
    if h is None:
        return None
    mhz, mw = ctypes.c_uint(), ctypes.c_uint()
    if _lib.nvmlDeviceGetClockInfo(h, ctypes.c_int(_NVML_CLOCK_SM), ctypes.byref(mhz)) != 0:
        return None
    power = mw.value / 1e3 if _lib.nvmlDeviceGetPowerUsage(h, ctypes.byref(mw)) == 0 else None
    return float(mhz.value), power


class Sampler:
    """with Sampler(index) as s: ...; s.summary() -> {"sm_mhz": median, "sm_mhz_min": min, "power_w": median} or
    None (no NVML, or no sample taken)."""

    def __init__(self, index: int = 0, period: float = 0.02):
        self.index, self.period = index, period
        self.samples = []
        self._stop = threading.Event()
        self._thread = None

    def _run(self):
        while not self._stop.is_set():
            s = sample(self.index)
            if s is None:
                return
            self.samples.append(s)
            self._stop.wait(self.period)

    def __enter__(self):
        if _handle(self.index) is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return False

    def summary(self):
        if not self.samples:
            return None
        mhz = [s[0] for s in self.samples]
        watts = [s[1] for s in self.samples if s[1] is not None]
        out = {"sm_mhz": statistics.median(mhz), "sm_mhz_min": min(mhz), "samples": len(mhz)}
        if watts:
            out["power_w"] = round(statistics.median(watts), 1)
        return out
