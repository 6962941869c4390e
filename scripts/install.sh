#!/usr/bin/env bash
# Install gemctl with a torch / fbgemm / torchrec set that matches.
#
#   bash scripts/install.sh [--cpu | --cuda] [--dev] [--no-movielens] [--torch VERSION]
#
# torch: kept if already installed; otherwise --torch VERSION (default 2.13.0) is installed, from
#   $TORCH_INDEX_URL when set (e.g. https://download.pytorch.org/whl/cu128 on a GPU cluster).
# fbgemm: the release that matches the installed torch (fbgemm and torch must match exactly):
#   CPU machines get fbgemm-gpu-cpu, CUDA machines (--cuda, or a CUDA build of torch) fbgemm-gpu
#   (from $FBGEMM_INDEX_URL when set, e.g. the same PyTorch CUDA index).
# torchrec: the matching release, with --no-deps (its own dependency on fbgemm-gpu would pull the
#   470 MiB CUDA build even on CPU machines); its light dependencies come with gemctl.
# MovieLens-100K: the recbole==1.2.1 wheel carries the files; installed with --no-deps (its own
#   dependencies are not needed: gemctl reads the files without importing recbole).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PIP=("$PY" -m pip install --disable-pip-version-check)
variant=auto dev=0 movielens=1 torch_version=2.13.0
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) variant=cpu ;;
    --cuda) variant=cuda ;;
    --dev) dev=1 ;;
    --no-movielens) movielens=0 ;;
    --torch) torch_version=$2; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "install.sh: unknown option '$1' (allowed: --cpu --cuda --dev --no-movielens --torch VERSION)" >&2; exit 2 ;;
  esac
  shift
done

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "== installing torch==$torch_version"
  "${PIP[@]}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} "torch==$torch_version"
fi
read -r torch_mm torch_cuda < <("$PY" -c "import torch; v=torch.__version__.split('+')[0].split('.'); print(v[0]+'.'+v[1], 'cuda' if torch.version.cuda else 'cpu')")
[ "$variant" = auto ] && variant=$torch_cuda

# torch minor -> "fbgemm torchrec" releases built for it.
case "$torch_mm" in
  2.11) fbgemm=1.6.0 torchrec=1.6.1 ;;
  2.12) fbgemm=1.7.0 torchrec=1.7.0 ;;
  2.13) fbgemm=1.8.0 torchrec=1.8.0 ;;
  2.14) fbgemm=1.9.0 torchrec=1.9.2 ;;
  *) echo "install.sh: torch $torch_mm has no known fbgemm/torchrec match (supported: 2.11-2.14)" >&2; exit 2 ;;
esac
if [ "$variant" = cuda ]; then fbgemm_pkg=fbgemm-gpu; else fbgemm_pkg=fbgemm-gpu-cpu; fi
echo "== torch $torch_mm ($variant): $fbgemm_pkg==$fbgemm, torchrec==$torchrec"
"${PIP[@]}" ${FBGEMM_INDEX_URL:+--extra-index-url "$FBGEMM_INDEX_URL"} "$fbgemm_pkg==$fbgemm"
"${PIP[@]}" --no-deps "torchrec==$torchrec"
[ "$movielens" = 1 ] && "${PIP[@]}" --no-deps "recbole==1.2.1"

extras=""
[ "$dev" = 1 ] && extras="[dev]"
echo "== installing gemctl$extras"
"${PIP[@]}" -e ".$extras"
"$PY" -c "import torch, torchrec, gemctl; print('gemctl', gemctl.__version__, '| torch', torch.__version__, '| torchrec', torchrec.__version__ if hasattr(torchrec, '__version__') else '$torchrec')"
