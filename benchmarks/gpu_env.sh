# Source on a GPU machine (no package registry there): makes `import ringcc` work for the
# system python without network. Tries an editable install first; falls back to a symlink
# tree that reproduces the package-dir mapping (passes/ -> ringcc.passes, runtime/ -> ringcc.runtime).
# Then prints where ringcc and torch come from and the GPUs (callers send it to their log).
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
_root="$(pwd)"
if ! python3 -m pip install -q --no-build-isolation --no-deps --no-index -e "$_root" >/tmp/ringcc_pip.log 2>&1; then
  mkdir -p /tmp/ringcc_site/ringcc
  for f in "$_root"/ringcc/*; do ln -sf "$f" /tmp/ringcc_site/ringcc/; done
  ln -sfn "$_root/passes" /tmp/ringcc_site/ringcc/passes
  ln -sfn "$_root/runtime" /tmp/ringcc_site/ringcc/runtime
  export PYTHONPATH="/tmp/ringcc_site:${PYTHONPATH:-}"
fi
python3 -c "import ringcc, torch; print('ringcc from', ringcc.__file__, 'torch', torch.__version__, 'cuda', torch.cuda.device_count())"
nvidia-smi --query-gpu=index,name,memory.total --format=csv 2>&1 || true
