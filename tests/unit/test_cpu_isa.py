"""Which instruction sets the custom CPU ops may use: what the CPU reports, capped by BLOCKSERVE_CPU_ISA, with AMX
only where Linux grants the process its tiles."""

from __future__ import annotations

import dataclasses
import typing

import pytest

import worker.kernels.cpu_isa as cpu_isa
from service.contract.config import Settings
from worker.kernels.cpu_isa import ISA_AMX, ISA_CAPS, IsaSet
from worker.kernels.selection import CPU_ISA_CAPS

SAPPHIRE_RAPIDS = {
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "avx512vbmi",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
}


@pytest.fixture
def granted(monkeypatch):
    monkeypatch.delenv(cpu_isa.AMX_EMULATION_VARIABLE, raising=False)

    def grant(answer: bool):
        monkeypatch.setattr(cpu_isa, "os_grants_amx", lambda: answer)

    return grant


@pytest.mark.parametrize(
    "cap, name",
    [("all", "avx512+bf16+vnni+amx"), ("avx512+bf16+vnni", "avx512+bf16+vnni"), ("avx512", "avx512"), ("avx2", "avx2")],
)
def test_each_cap_keeps_the_ops_at_or_below_its_level(granted, cap, name):
    granted(True)
    isa = IsaSet.of(SAPPHIRE_RAPIDS, cap)

    assert isa.name == name
    assert bool(isa.bits & ISA_AMX) == (cap == "all")


def test_amx_needs_the_os_grant_all_three_of_its_flags_and_vbmi(granted):
    granted(False)
    assert not IsaSet.of(SAPPHIRE_RAPIDS).amx
    granted(True)
    assert IsaSet.of(SAPPHIRE_RAPIDS).amx
    for flag in ("amx_tile", "amx_bf16", "amx_int8", "avx512_bf16", "avx512vbmi"):
        assert not IsaSet.of(SAPPHIRE_RAPIDS - {flag}).amx, flag


def test_the_tests_amx_emulation_needs_vbmi_beside_the_dot_products_and_no_tiles(granted, monkeypatch):
    """tests/integration/test_amx_emulated.py: the ops built with the tiles emulated run the AMX kernel set where
    the CPU has everything else that set uses; only "all" reaches it, as on an AMX CPU."""
    granted(False)
    zen4 = SAPPHIRE_RAPIDS - {"amx_tile", "amx_bf16", "amx_int8"}
    assert not IsaSet.of(zen4).amx
    monkeypatch.setenv(cpu_isa.AMX_EMULATION_VARIABLE, "1")
    assert IsaSet.of(zen4).amx
    assert not IsaSet.of(zen4, "avx512+bf16+vnni").amx
    for flag in ("avx512vbmi", "avx512_bf16", "avx512_vnni"):
        assert not IsaSet.of(zen4 - {flag}).amx, flag


def test_every_cpu_isa_setting_names_a_cap():
    settings_values = typing.get_args(Settings.model_fields["cpu_isa"].annotation)

    assert set(settings_values) == set(CPU_ISA_CAPS)
    assert set(CPU_ISA_CAPS.values()) == set(ISA_CAPS)


def test_onednns_rows_travel_above_the_instruction_set_bits_and_leave_the_name_alone():
    """custom_ops/cpu/isa.h reads the rows from kOneDnnRowsShift up: GEMMs of bf16 weights from that many rows on
    oneDNN's matmul (0: never)."""
    isa = IsaSet(avx512=True, bf16=True, vnni=True, amx=True)
    routed = dataclasses.replace(isa, onednn_rows=512)
    assert routed.bits == isa.bits | 512 << cpu_isa.ONEDNN_ROWS_SHIFT and isa.bits < 1 << cpu_isa.ONEDNN_ROWS_SHIFT
    assert routed.bits >> cpu_isa.ONEDNN_ROWS_SHIFT == 512 and routed.name == isa.name
