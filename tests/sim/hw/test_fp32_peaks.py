"""The catalog's FP32 peaks (``peak_fp32_tflops``): the figures the cited sources give, below the tensor peaks,
parsed in FLOP/s, required, and divided by a slowdown like the tensor peak.

Oracles: the fp32 column of the reference notes' GPU table and the vendor figures cited in devices.yaml, typed in
here as the sources print them, and the unit arithmetic SMs (or CUs) x FP32 lanes x 2 FLOP per FMA x clock.
"""

from __future__ import annotations

import shutil
from importlib.resources import files
from pathlib import Path

import pytest
import yaml

from sim.core.errors import SpecError
from sim.hw.catalog import get_device, list_devices, load_catalog, slowed_device

# Dense FP32 TFLOP/s per catalog device, as its source prints it: hardware.md §1.1 (fp32 column) for the first
# fourteen; NVIDIA's HGX B200 table (600 over 8 GPUs), the L40S datasheet and AMD's MI300X table for three of the
# rest; H200, GH200, H800 and the 96 GB HBM2e H100 are the H100 SXM5's die (66.9, rounded to 67 as §1.1 rounds the
# H100's; the last [assumed] in devices.yaml, its 500 W clocks unpublished); the P100 PCIe's
# 9.3 is NVIDIA's launch table as devices.yaml cites it; GB200 90 (glennklockwood's 1,200 W table, VFMA), GB300 80
# and B300 75 (verda.com's Blackwell Ultra table, 0.080 and 0.075 PFLOPS).
FP32_TFLOPS = {
    "v100-sxm2-16gb": 15.7, "v100-sxm2-32gb": 15.7, "v100-pcie-16gb": 14.0, "v100-pcie-32gb": 14.0,
    "a100-sxm4-40gb": 19.5, "a100-sxm4-80gb": 19.5, "a100-pcie-40gb": 19.5, "a100-pcie-80gb": 19.5,
    "h100-sxm5-80gb": 67.0, "h100-pcie-80gb": 51.0, "t4-16gb": 8.1, "a10-24gb": 31.2, "rtx3090-24gb": 35.6,
    "rtx4090-24gb": 82.6, "h200-sxm-141gb": 67.0, "gh200-96gb": 67.0, "h800-sxm5-80gb": 67.0,
    "h100-sxm-96gb-hbm2e": 67.0, "b200-sxm-180gb": 600 / 8, "gb200": 90.0, "gb300": 80.0, "b300-sxm-270gb": 75.0,
    "l40s-48gb": 91.6, "mi300x-192gb": 163.4, "p100-pcie-16gb": 9.3,
}  # fmt: skip


def test_every_gpu_has_its_cited_fp32_peak_in_flops() -> None:
    gpus = [d for d in list_devices() if d.is_gpu]
    assert sorted(d.name for d in gpus) == sorted(FP32_TFLOPS)
    for device in gpus:
        assert device.peak_fp32_flops == pytest.approx(FP32_TFLOPS[device.name] * 1e12, rel=1e-12), device.name


@pytest.mark.parametrize("device", [d for d in list_devices() if d.is_gpu], ids=lambda d: d.name)
def test_the_fp32_peak_is_below_the_tensor_peak(device) -> None:
    # No exception is needed: even on GeForce, whose tensor peak is the FP32-accumulate rate (half the FP16-accumulate
    # one), the CUDA-core FP32 rate is about half of that again (RTX 3090: 35.6 against 71; RTX 4090: 82.6 against
    # 165.2).
    assert device.peak_fp32_flops < device.peak_flops


def test_the_cpu_and_the_ideal_device_have_one_rate_for_both_precisions() -> None:
    # The CPU figure is a measured fp32 matmul (no tensor cores); the ideal device is precision-blind.
    for name, tflops in (("cpu", 0.128), ("ideal", 100.0)):
        device = get_device(name)
        assert device.peak_fp32_flops == device.peak_flops == pytest.approx(tflops * 1e12, rel=1e-12)


@pytest.mark.parametrize(
    ("name", "units", "flop_per_clock", "clock_hz"),
    [
        ("H200", 132, 128 * 2, 1.98e9),  # SMs x FP32 lanes x FMA, boost clock
        ("GH200", 132, 128 * 2, 1.98e9),
        ("L40S", 142, 128 * 2, 2.52e9),  # 18,176 CUDA cores = 142 SMs x 128
        ("MI300X", 304, 256, 2.1e9),  # AMD's 256 FP32 FLOPS per clock per CU, peak engine clock
        ("V100", 80, 64 * 2, 1.53e9),  # 5120 CUDA cores
        ("P100", 56, 64 * 2, 1.30e9),  # 3584 CUDA cores, the PCIe card's 1300 MHz boost
    ],
)
def test_the_fp32_peak_is_units_times_lanes_times_clock(name: str, units: int, flop_per_clock: int,
                                                        clock_hz: float) -> None:
    device = get_device(name)
    assert device.compute_units == units
    # the sources print three significant figures: 15.7 for 15.67, 67 (66.9) for 66.91
    assert device.peak_fp32_flops == pytest.approx(units * flop_per_clock * clock_hz, rel=4e-3)


def test_a_slowed_device_divides_its_fp32_peak_too() -> None:
    v100 = get_device("V100")
    slow = slowed_device(slowed_device(v100, 2), 1.5)
    assert slow.peak_fp32_flops == pytest.approx(15.7e12 / 3, rel=1e-15)
    assert slow.peak_flops == pytest.approx(125e12 / 3, rel=1e-15)


@pytest.fixture
def catalog_dir(tmp_path: Path) -> Path:
    source = files("profiles") / "hardware"
    for name in ("devices.yaml", "links.yaml"):
        shutil.copy(str(source / name), tmp_path / name)
    return tmp_path


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda d: d["devices"][0].pop("peak_fp32_tflops"), "missing field(s) ['peak_fp32_tflops']"),
        (lambda d: d["devices"][1].update(peak_fp32_tflops=0), "'peak_fp32_tflops' must be a finite number > 0, got 0"),
        (lambda d: d["devices"][1].update(peak_fp32_tflops=float("inf")), "got inf"),
        (lambda d: d["devices"][2].update(peak_fp32_tflops="fast"), "got 'fast'"),
    ],
)
def test_a_missing_or_bad_fp32_peak_fails_naming_the_entry_and_field(catalog_dir: Path, edit, expected: str) -> None:
    path = catalog_dir / "devices.yaml"
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SpecError, match="devices.yaml: devices") as info:
        load_catalog(catalog_dir)
    assert expected in str(info.value)
