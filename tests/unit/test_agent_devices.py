"""The agent finds its devices without CUDA: nvidia-smi text and CUDA_VISIBLE_DEVICES, else CPU slots."""

from __future__ import annotations

import subprocess
import sys

import pytest

from flodl_zmq.agent_rules import cuda_devices, device_env, parse_nvidia_smi, resolve_devices
from flodl_zmq.errors import ConfigError

SMI = (
    "GPU 0: NVIDIA H200 (UUID: GPU-11111111-aaaa-bbbb-cccc-000000000000)\n"
    "GPU 1: NVIDIA H200 (UUID: GPU-22222222-aaaa-bbbb-cccc-000000000000)\n"
)


def test_nvidia_smi_listing_is_parsed_to_indices_and_uuids():
    assert parse_nvidia_smi(SMI) == [
        ("0", "GPU-11111111-aaaa-bbbb-cccc-000000000000"),
        ("1", "GPU-22222222-aaaa-bbbb-cccc-000000000000"),
    ]
    assert parse_nvidia_smi("NVIDIA-SMI has failed because it couldn't communicate with the driver") == []


def test_every_gpu_is_offered_when_cuda_visible_devices_is_unset():
    assert cuda_devices({}, SMI) == ["cuda:0", "cuda:1"]


@pytest.mark.parametrize(
    ("visible", "expected"),
    [("1", ["cuda:1"]), ("1,0", ["cuda:1", "cuda:0"]), ("", []), ("-1", []), ("0,7,1", ["cuda:0"]),
     ("GPU-2222", ["cuda:GPU-2222"])],
)
def test_cuda_visible_devices_restricts_the_offer(visible, expected):
    assert cuda_devices({"CUDA_VISIBLE_DEVICES": visible}, SMI) == expected


def test_no_driver_falls_back_to_cpu_slots_and_explicit_devices_win():
    assert resolve_devices(None, 3, {}, None) == ("cpu:0", "cpu:1", "cpu:2")
    assert resolve_devices(None, 3, {}, SMI) == ("cuda:0", "cuda:1")
    assert resolve_devices(["cpu:0", "cpu:1"], 0, {}, SMI) == ("cpu:0", "cpu:1")
    with pytest.raises(ConfigError, match="cpu-slots"):
        resolve_devices(None, 0, {}, None)
    with pytest.raises(ConfigError, match="cuda:ID or cpu:N"):
        resolve_devices(["gpu0"], 0, {}, None)
    with pytest.raises(ConfigError, match="distinct"):
        resolve_devices(["cpu:0", "cpu:0"], 0, {}, None)


def test_a_rank_is_pinned_to_its_gpu_and_a_cpu_slot_sees_none():
    assert device_env("cuda:3") == {"CUDA_VISIBLE_DEVICES": "3"}
    assert device_env("cpu:1") == {"CUDA_VISIBLE_DEVICES": ""}


def test_the_agent_the_relay_and_the_command_line_never_import_torch():
    # Neither the agent nor a `flodl-zmq` command trains: importing torch would cost each seconds
    # of the cores the ranks train on. The relay loads it when it starts (its bf16 kernels), not
    # when it is imported.
    code = ("import sys, flodl_zmq.agent, flodl_zmq.membership, flodl_zmq.relay, flodl_zmq.cli; "
            "flodl_zmq.cli.build_parser(); sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
