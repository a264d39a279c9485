"""Tests for the hardware catalog (sim.hw.catalog, profiles/hardware/*.yaml)."""

from __future__ import annotations

import dataclasses
import math
import shutil
from importlib.resources import files
from pathlib import Path

import pytest
import yaml

from sim.core.errors import SpecError
from sim.hw.catalog import (
    DeviceSpec,
    device_aliases,
    get_device,
    get_link,
    list_devices,
    list_links,
    load_catalog,
)

CONTRACT_LINKS = [
    "nvlink2-x1", "nvlink2-x2", "nvswitch-v100", "nvswitch-a100", "nvswitch-h100", "nvswitch-h800", "nvswitch-h200",
    "nvswitch-b200",
    "nvlink-switch-nvl72", "nvlink4-x6", "xgmi-mi300x", "nvlink-c2c", "ici-tpu-v3", "pcie3-x16", "pcie4-x16",
    "pcie5-x16", "pcie6-x16", "ib-edr",
    "ib-hdr", "ib-ndr", "ib-xdr", "slingshot-11", "roce-200g", "roce-400g", "eth-10g", "eth-25g", "eth-100g",
    "loopback", "ideal",
]  # fmt: skip
CONTRACT_DEVICES = [
    "v100-sxm2-16gb", "v100-sxm2-32gb", "v100-pcie-16gb", "v100-pcie-32gb", "a100-sxm4-40gb", "a100-sxm4-80gb",
    "a100-pcie-40gb", "a100-pcie-80gb", "h100-sxm5-80gb", "h800-sxm5-80gb", "h100-pcie-80gb", "t4-16gb", "a10-24gb",
    "rtx3090-24gb",
    "rtx4090-24gb", "h200-sxm-141gb", "h100-sxm-96gb-hbm2e", "gh200-96gb", "b200-sxm-180gb", "gb200", "gb300",
    "b300-sxm-270gb", "l40s-48gb",
    "mi300x-192gb", "p100-pcie-16gb",
    "tpu-v3-core", "cpu", "ideal",
]  # fmt: skip


@pytest.mark.parametrize(
    ("alias", "name"),
    [
        ("V100", "v100-sxm2-32gb"),
        ("V100-PCIE", "v100-pcie-32gb"),
        ("A100", "a100-sxm4-80gb"),
        ("A100-PCIE", "a100-pcie-80gb"),
        ("H100", "h100-sxm5-80gb"),
        ("H100-PCIE", "h100-pcie-80gb"),
        ("T4", "t4-16gb"),
        ("A10", "a10-24gb"),
        ("RTX3090", "rtx3090-24gb"),
        ("RTX4090", "rtx4090-24gb"),
        ("H200", "h200-sxm-141gb"),
        ("GH200", "gh200-96gb"),
        ("H100-HBM2E", "h100-sxm-96gb-hbm2e"),
        ("B200", "b200-sxm-180gb"),
        ("L40S", "l40s-48gb"),
        ("MI300X", "mi300x-192gb"),
        ("P100", "p100-pcie-16gb"),
        ("tpuv3", "tpu-v3-core"),
        ("mi300x", "mi300x-192gb"),
        ("ideal", "ideal"),
        ("v100", "v100-sxm2-32gb"),
        ("a100-pcie", "a100-pcie-80gb"),
        ("V100-SXM2-16GB", "v100-sxm2-16gb"),
        (" h100-sxm5-80gb ", "h100-sxm5-80gb"),
    ],
)
def test_aliases_and_ids_resolve_case_insensitively(alias: str, name: str) -> None:
    assert get_device(alias).name == name


def test_catalog_holds_every_contract_device_and_link() -> None:
    assert [d.name for d in list_devices()] == CONTRACT_DEVICES
    assert [link.name for link in list_links()] == CONTRACT_LINKS
    assert all(isinstance(d, DeviceSpec) for d in list_devices())


def test_values_are_converted_to_si_units() -> None:
    v100 = get_device("V100")
    assert (v100.peak_flops, v100.memory_bytes, v100.memory_bandwidth) == (125e12, 32e9, 900e9)
    assert v100.matmul_efficiency == 0.78 and v100.host_link == "pcie3-x16"
    assert v100.launch_overhead_s == 5e-6
    h100 = get_device("H100")
    assert (h100.peak_flops, h100.memory_bandwidth, h100.host_link) == (989e12, 3350e9, "pcie5-x16")
    assert get_device("RTX3090").peak_flops == 71e12  # FP32-accumulate rate, hardware.md §0
    pcie3 = get_link("pcie3-x16")
    assert (pcie3.bandwidth, pcie3.spec_bandwidth, pcie3.latency) == (11e9, 15.75e9, 7.5e-6)
    assert get_link("nvlink2-x2").bandwidth == 2 * get_link("nvlink2-x1").bandwidth


def test_ideal_device_and_link() -> None:
    ideal = get_device("ideal")
    assert (ideal.peak_flops, ideal.matmul_efficiency, ideal.launch_overhead_s) == (100e12, 1.0, 0.0)
    assert math.isinf(ideal.memory_bytes) and math.isinf(ideal.memory_bandwidth)
    assert ideal.host_link == "ideal"
    link = get_link("ideal")
    assert math.isinf(link.bandwidth) and math.isinf(link.spec_bandwidth) and link.latency == 0


@pytest.mark.parametrize("device", list_devices(), ids=lambda d: d.name)
def test_every_device_is_consistent_and_cited(device: DeviceSpec) -> None:
    assert 0 < device.matmul_efficiency <= 1
    assert device.peak_flops > 0 and device.memory_bytes > 0 and device.memory_bandwidth > 0
    expected_host_link = {"ideal": "ideal", "cpu": "loopback", "gh200-96gb": "nvlink-c2c", "gb200": "nvlink-c2c",
                          "gb300": "nvlink-c2c"}.get(device.name)
    assert get_link(device.host_link).name.startswith("pcie") or device.host_link == expected_host_link
    if device.name == "cpu":  # measured by this project on its own machine
        assert "[meas: this project" in device.source
    elif device.name != "ideal":  # GPUs cite the reference notes or, for what those lack, a public URL
        assert "hardware.md §" in device.source or "https://" in device.source
        assert math.isfinite(device.memory_bytes) and device.launch_overhead_s <= 50e-6
        # A GPU launches each kernel from the host; a TPU core runs one compiled program per step (its source says so)
        assert device.launch_overhead_s >= 1e-6 if device.is_gpu else "XLA compiles the whole step" in device.source


@pytest.mark.parametrize("device", list_devices(), ids=lambda d: d.name)
def test_the_attention_kernel_runs_at_its_cited_efficiency_or_the_gemms(device: DeviceSpec) -> None:
    assert 0 <= device.attention_efficiency <= 1
    expected = device.attention_efficiency or device.matmul_efficiency
    assert device.attention_throughput == device.peak_flops * expected
    if device.attention_efficiency:  # FlashAttention-2 on Hopper: FlashAttention-3's abstract, or assumed from it
        assert "FlashAttention-3" in device.source and "35 %" in device.source


@pytest.mark.parametrize("link", list_links(), ids=lambda link: link.name)
def test_every_link_is_consistent_and_cited(link) -> None:
    assert 0 < link.bandwidth <= link.spec_bandwidth
    assert link.latency >= 0
    if link.name != "ideal":
        cited = ("simulators.md §",) if link.name == "loopback" else ("hardware.md §", "https://")
        assert any(c in link.source for c in cited) and math.isfinite(link.bandwidth) and link.latency > 0


def test_specs_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_device("V100").peak_flops = 1.0  # type: ignore[misc]


def test_unknown_device_names_the_value_and_suggests() -> None:
    with pytest.raises(SpecError, match="V1OO") as info:
        get_device("V1OO")
    assert "did you mean v100" in str(info.value)
    with pytest.raises(SpecError, match="'nvlink9'"):
        get_link("nvlink9")
    with pytest.raises(SpecError):
        get_device(None)  # type: ignore[arg-type]


def test_device_aliases() -> None:
    assert device_aliases("a100-sxm4-80gb") == ("A100",)
    assert device_aliases("V100") == ("V100",)
    assert device_aliases("v100-sxm2-16gb") == ()


# --- broken data files: each must fail with the file, entry and field in the message -----------------------------


@pytest.fixture
def catalog_dir(tmp_path: Path) -> Path:
    source = files("profiles") / "hardware"
    for name in ("devices.yaml", "links.yaml"):
        shutil.copy(str(source / name), tmp_path / name)
    return tmp_path


def _edit(path: Path, edit) -> None:
    data = yaml.safe_load(path.read_text())
    edit(data)
    path.write_text(yaml.safe_dump(data))


def test_copied_catalog_loads_identically(catalog_dir: Path) -> None:
    catalog = load_catalog(catalog_dir)
    assert tuple(catalog.devices.values()) == list_devices()
    assert tuple(catalog.links.values()) == list_links()


@pytest.mark.parametrize(
    ("file", "edit", "expected"),
    [
        ("devices.yaml", lambda d: d["devices"][0].pop("peak_tflops"), "peak_tflops"),
        ("devices.yaml", lambda d: d["devices"][1].update(peak_tflops=-1), "peak_tflops"),
        ("devices.yaml", lambda d: d["devices"][1].update(memory_gb="lots"), "memory_gb"),
        ("devices.yaml", lambda d: d["devices"][1].update(memory_gb=float("inf")), "memory_gb"),
        ("devices.yaml", lambda d: d["devices"][2].update(matmul_efficiency=1.5), "matmul_efficiency"),
        ("devices.yaml", lambda d: d["devices"][2].update(host_link="pcie9-x16"), "pcie9-x16"),
        ("devices.yaml", lambda d: d["devices"][3].update(aliases=["V100"]), "'V100'"),
        ("devices.yaml", lambda d: d["devices"][3].update(source=""), "source"),
        ("devices.yaml", lambda d: d["devices"][3].update(colour="green"), "colour"),
        ("devices.yaml", lambda d: d.pop("devices"), "devices"),
        ("links.yaml", lambda d: d["links"][0].update(latency_us=-2), "latency_us"),
        ("links.yaml", lambda d: d["links"][0].update(bandwidth_gbs=True), "bandwidth_gbs"),
        ("links.yaml", lambda d: d["links"].append(dict(d["links"][0])), "appears twice"),
    ],
)
def test_broken_catalog_fails_clearly(catalog_dir: Path, file: str, edit, expected: str) -> None:
    _edit(catalog_dir / file, edit)
    with pytest.raises(SpecError, match=file) as info:
        load_catalog(catalog_dir)
    assert expected in str(info.value)


def test_malformed_catalog_yaml_fails_clearly(catalog_dir: Path) -> None:
    (catalog_dir / "links.yaml").write_text("links: [unclosed\n")
    with pytest.raises(SpecError, match="links.yaml.*malformed YAML"):
        load_catalog(catalog_dir)


def test_fp4_peaks_where_the_devices_have_fp4() -> None:
    # stas00/ml-engineering's TFLOPS table (b9e29720), fp4 column, dense: B200 9000; glennklockwood's GB200 table
    # (1,200 W) 10000; verda.com's Blackwell Ultra table: GB300 15 PFLOPS, B300 14; no FP4 before Blackwell.
    blackwell = {"b200-sxm-180gb": 9000e12, "gb200": 10000e12, "gb300": 15000e12, "b300-sxm-270gb": 14000e12}
    assert {d.name: d.peak_fp4_flops for d in list_devices() if d.peak_fp4_flops} == blackwell
