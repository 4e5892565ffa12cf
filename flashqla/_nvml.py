"""The SM clock and board power while a benchmark times a call (NVML through ctypes: the driver's own library, so no
Python package is needed, where torch.cuda.clock_rate needs pynvml), so that a record says at what clock each time
was taken. A thread samples every `period` seconds; `Sampler.summary()` gives the medians. Without NVML (no driver,
a CPU machine) the sampler takes no samples and the summary is None. The device index is NVML's: the CUDA device's
where CUDA_VISIBLE_DEVICES is unset (the benchmark machines' case).
"""
import ctypes
import functools
import statistics
import threading

_NVML_CLOCK_SM = 1  # nvmlClockType_t (NVML_CLOCK_GRAPHICS 0, NVML_CLOCK_SM 1): the clock the kernels run at


@functools.lru_cache(maxsize=1)
def _nvml():
    """The initialised NVML library, or None."""
    try:
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        return lib if lib.nvmlInit_v2() == 0 else None
    except (OSError, AttributeError):
        return None


def _handle(index: int):
    """NVML's handle of device `index`, or None."""
    lib = _nvml()
    h = ctypes.c_void_p()
    return h if lib is not None and lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(h)) == 0 \
        else None


def _read(h):
    """(SM clock in MHz, board power in W or None) of handle h now, or None."""
    lib = _nvml()
    mhz, mw = ctypes.c_uint(), ctypes.c_uint()
    if lib.nvmlDeviceGetClockInfo(h, ctypes.c_int(_NVML_CLOCK_SM), ctypes.byref(mhz)) != 0:
        return None
    return float(mhz.value), (mw.value / 1e3 if lib.nvmlDeviceGetPowerUsage(h, ctypes.byref(mw)) == 0 else None)


class Sampler:
    """with Sampler(index) as s: ...; s.summary() -> {"sm_mhz": median, "sm_mhz_min": min, "samples": n,
    "power_w": median} or None (no NVML, or no sample taken)."""

    def __init__(self, index: int = 0, period: float = 0.02):
        self.index, self.period = index, period
        self.samples = []
        self._stop = threading.Event()
        self._thread = None

    def _run(self, h):
        while not self._stop.is_set() and (s := _read(h)) is not None:
            self.samples.append(s)
            self._stop.wait(self.period)

    def __enter__(self):
        h = _handle(self.index)
        if h is not None:
            self._thread = threading.Thread(target=self._run, args=(h,), daemon=True)
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
