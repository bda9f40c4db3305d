"""The worker's OpenMP defaults: libiomp5 sleeps at once, libgomp spins a bounded while, set values win."""

from __future__ import annotations

import os

import pytest

from worker.host.cpu_threads import GOMP_SPIN_ROUNDS, set_thread_defaults

VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT")


@pytest.fixture
def clean_env(monkeypatch):
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_unset_variables_get_a_bounded_libgomp_spin_and_no_libiomp5_spin(clean_env):
    set_thread_defaults()
    assert os.environ["OMP_NUM_THREADS"] == str(os.cpu_count() or 1)
    assert os.environ["KMP_BLOCKTIME"] == "0"
    assert os.environ["GOMP_SPINCOUNT"] == GOMP_SPIN_ROUNDS
    assert "OMP_WAIT_POLICY" not in os.environ  # PASSIVE would put libgomp to sleep at every barrier


def test_a_set_wait_policy_keeps_its_own_spin_count(clean_env):
    clean_env.setenv("OMP_WAIT_POLICY", "PASSIVE")
    set_thread_defaults()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "GOMP_SPINCOUNT" not in os.environ


def test_set_values_win(clean_env):
    clean_env.setenv("OMP_NUM_THREADS", "3")
    clean_env.setenv("KMP_BLOCKTIME", "200")
    clean_env.setenv("GOMP_SPINCOUNT", "0")
    set_thread_defaults()
    assert (os.environ["OMP_NUM_THREADS"], os.environ["KMP_BLOCKTIME"], os.environ["GOMP_SPINCOUNT"]) == (
        "3",
        "200",
        "0",
    )
