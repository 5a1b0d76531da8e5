#!/usr/bin/env bash
# Run HERE (a machine with internet), before a GPU session: puts the comparison providers that the GPU machine
# lacks into .gpu/site (ignored by git; pass carry=[".gpu"] to the device tool), where scripts/gpu_check.sh finds
# them on PYTHONPATH.
#   - Liger-Kernel: its pure-Python wheel, unpacked.
#   - flash-attention: only its Triton rotary (flash_attn/ops/triton/rotary.py and flash_attn/layers/rotary.py,
#     which is what flash_attn.layers.rotary.apply_rotary_emb runs) from the sdist, under empty package __init__
#     files: the real flash_attn/__init__.py imports the compiled attention extension, which has no wheel here.
#   - einops, which flash_attn/layers/rotary.py imports (the GPU machine has it; this one may not).
# Nothing of theirs is committed; the benchmark imports them only when present. At the end it runs both through
# every mode of benchmarks/rope.py on the CPU (scripts/gpu_providers_check.py), so a call mistake shows here.
set -euo pipefail
cd "$(dirname "$0")/.."
LIGER=${LIGER:-0.8.5}
FLASH=${FLASH:-2.8.3}
EINOPS=${EINOPS:-0.8.1}
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >>.git/info/exclude
rm -rf .gpu && mkdir -p .gpu/download .gpu/site
python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/download "liger-kernel==$LIGER"
python3 -m zipfile -e .gpu/download/liger_kernel-*.whl .gpu/site
python3 -m pip download -q --no-deps --only-binary=:all: -d .gpu/download "einops==$EINOPS"
python3 -m zipfile -e .gpu/download/einops-*.whl .gpu/site
python3 - "$FLASH" <<'PY'
import re, sys, tarfile, urllib.request
from pathlib import Path

version = sys.argv[1]
html = urllib.request.urlopen("https://pypi.org/simple/flash-attn/").read().decode()
url = re.findall(rf'href="([^"]*flash_attn-{re.escape(version)}\.tar\.gz[^"]*)"', html)[0].replace("&amp;", "&")
archive = Path(".gpu/download") / f"flash_attn-{version}.tar.gz"
urllib.request.urlretrieve(url, archive)
site = Path(".gpu/site")
with tarfile.open(archive) as tar:
    for name in ("flash_attn/ops/triton/rotary.py", "flash_attn/layers/rotary.py"):
        member = tar.extractfile(f"flash_attn-{version}/{name}")
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_bytes(member.read())
for package in ("flash_attn", "flash_attn/ops", "flash_attn/ops/triton", "flash_attn/layers"):
    (site / package / "__init__.py").write_text("")
PY
rm -rf .gpu/download
du -sh .gpu
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
TRITON_INTERPRET=1 "$PYTHON" scripts/gpu_providers_check.py
