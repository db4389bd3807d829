"""The package metadata (pyproject.toml) declares version ranges, never exact pins, and keeps the CPU and
CUDA builds of fbgemm apart; the exact set `make` installs (constraints-cpu.txt) lies inside those ranges
and is what the README says was tested."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CONSTRAINTS = ROOT / "constraints-cpu.txt"


def requirements() -> list[tuple[str, Requirement]]:
    """(where, requirement) of every dependency and extra."""
    out = [("dependencies", Requirement(r)) for r in PROJECT["dependencies"]]
    for extra, reqs in PROJECT["optional-dependencies"].items():
        out += [(f"[{extra}]", Requirement(r)) for r in reqs]
    return out


def pins() -> dict[str, Version]:
    found = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            found[name.strip().lower()] = Version(version.strip())
    return found


@pytest.mark.parametrize("where,req", requirements(), ids=lambda x: str(x))
def test_no_requirement_is_pinned_exactly(where, req):
    for spec in req.specifier:
        assert spec.operator not in ("==", "==="), (
            f"pyproject.toml {where} pins {req}: declare the range cnrstore supports (a lower bound, or ~=), "
            "and put the exact tested version in constraints-cpu.txt")


def test_torch_is_a_range_with_the_lowest_version_cnrstore_needs():
    torch_req = next(r for where, r in requirements() if where == "dependencies" and r.name == "torch")
    lows = [Version(s.version) for s in torch_req.specifier if s.operator == ">="]
    assert lows == [Version("2.6")], torch_req  # torch.serialization.get_unsafe_globals_in_checkpoint (2.6)
    assert not torch_req.specifier.contains("2.5.1")
    for later in ("2.6.0", "2.13.0", "2.14.1", "3.0"):
        assert torch_req.specifier.contains(later), later


def test_cpu_and_cuda_extras_do_not_mix_fbgemm_builds():
    extras = {name: {Requirement(r).name.lower() for r in reqs}
              for name, reqs in PROJECT["optional-dependencies"].items()}
    assert "fbgemm-gpu-cpu" in extras["torchrec-cpu"]
    # torchrec's own metadata names the CUDA fbgemm-gpu: the CPU extra leaves torchrec to `pip install --no-deps`
    assert not extras["torchrec-cpu"] & {"fbgemm-gpu", "torchrec"}
    assert {"torchrec", "fbgemm-gpu"} <= extras["torchrec-cuda"]
    assert "fbgemm-gpu-cpu" not in extras["torchrec-cuda"]
    for name, names in extras.items():  # no extra forces the CPU build on a CUDA image by the back door
        assert not ("fbgemm-gpu-cpu" in names and name != "torchrec-cpu"), name


def test_constraints_pin_the_tested_set_inside_the_declared_ranges():
    pinned = pins()
    assert {"torch", "fbgemm-gpu-cpu", "torchrec"} <= set(pinned)
    for where, req in requirements():
        if req.name.lower() in pinned:
            assert req.specifier.contains(pinned[req.name.lower()]), f"{where} {req} excludes the tested {pinned}"
    # fbgemm and torchrec 1.N pair with torch 2.(N+5)
    torch_v = pinned["torch"]
    for name in ("fbgemm-gpu-cpu", "torchrec"):
        assert (pinned[name].major + 1, pinned[name].minor + 5) == (torch_v.major, torch_v.minor), (name, pinned)


def test_makefile_and_readme_name_the_tested_versions():
    pinned = pins()
    makefile = (ROOT / "Makefile").read_text()
    assert f'"torch=={pinned["torch"]}"' in makefile and "-c constraints-cpu.txt" in makefile
    assert f'"torchrec=={pinned["torchrec"]}"' in makefile and "torchrec-cpu" in makefile
    readme = (ROOT / "README.md").read_text()
    assert "## Installing into a CUDA image" in readme or "### Installing into a CUDA image" in readme
    for name in ("torch", "torchrec", "fbgemm-gpu-cpu"):
        assert re.search(rf"{re.escape(name)}[ =]+{re.escape(str(pinned[name]))}", readme), (
            f"README does not name the tested {name} {pinned[name]}")


def test_this_environment_satisfies_the_declared_ranges():
    for where, req in requirements():
        if where != "dependencies":
            continue
        try:
            installed = Version(importlib.metadata.version(req.name))
        except importlib.metadata.PackageNotFoundError:
            pytest.fail(f"{req.name} is a dependency but not installed")
        assert req.specifier.contains(installed, prereleases=True), f"{req.name} {installed} is outside {req}"
