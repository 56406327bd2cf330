"""OpenMP's barrier spin, settled before torch loads (core/environment.py settle_openmp): the
package's default where the user chose nothing, the user's choice where they did."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = ("import json, os, sys\n"
         "{first}"
         "import turborag_integrations\n"
         "print(json.dumps({{'spin': os.environ.get('GOMP_SPINCOUNT'),"
         " 'policy': os.environ.get('OMP_WAIT_POLICY')}}))\n")


def imported(env: dict, first: str = "") -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], env={**base, **env},
                         capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_package_spins_briefly_where_nothing_is_set():
    assert imported({}) == {"spin": "1000", "policy": None}


@pytest.mark.parametrize("env", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}])
def test_a_users_own_openmp_setting_is_kept(env):
    got = imported(env)
    assert got == {"spin": env.get("GOMP_SPINCOUNT"), "policy": env.get("OMP_WAIT_POLICY")}


def test_torch_loaded_first_keeps_openmps_default():
    """OpenMP has read its environment already: setting it then would claim what it does not do."""
    assert imported({}, first="import torch\n") == {"spin": None, "policy": None}
