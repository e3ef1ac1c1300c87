"""The C kernels built for every instruction set they claim, checked by a C program (tests/native/
check_kernels.c) against double references and for batch invariance: this machine's own build,
x86-64-v3 (AVX2 + FMA: AMD Zen 2/3), x86-64-v2 (SSE4 only) and, where a cross compiler and qemu-user are
installed (scripts/test.sh installs them in CI), aarch64 (NEON) run under qemu. The Python suite loads
the native and x86-64-v3 builds itself; this covers the builds it cannot load."""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

CHECK = Path(__file__).parent / "native" / "check_kernels.c"
X86 = platform.machine() == "x86_64"

BUILDS = [
    pytest.param("cc", ["-march=native"], [], "", id="native"),
    pytest.param("cc", ["-march=x86-64-v3"], [], "avx2", id="x86-64-v3",
                 marks=pytest.mark.skipif(not X86, reason="an x86 build")),
    pytest.param("cc", ["-march=x86-64-v2"], [], "generic", id="x86-64-v2",
                 marks=pytest.mark.skipif(not X86, reason="an x86 build")),
    pytest.param("aarch64-linux-gnu-gcc", ["-march=armv8-a"], ["qemu-aarch64", "-L", "/usr/aarch64-linux-gnu"],
                 "neon", id="aarch64-qemu"),
]


@pytest.mark.slow
@pytest.mark.parametrize("compiler,flags,runner,isa", BUILDS)
def test_kernels_check_passes(tmp_path, compiler, flags, runner, isa):
    if shutil.which(compiler) is None or (runner and shutil.which(runner[0]) is None):
        pytest.skip(f"needs {compiler}{' and ' + runner[0] if runner else ''} "
                    "(apt-get install gcc-aarch64-linux-gnu qemu-user)")
    exe = tmp_path / "check"
    build = subprocess.run([compiler, "-O2", *flags, "-fopenmp", "-Wno-psabi", str(CHECK), "-o", str(exe), "-lm"],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-3000:]
    res = subprocess.run([*runner, str(exe)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and " 0 failed" in res.stdout, res.stdout + res.stderr
    if isa:
        assert f"kernels check ({isa}," in res.stdout, res.stdout
