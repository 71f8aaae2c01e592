# Shared set-up of the H200 check scripts (sourced, not run).
# gpu_setup DEFAULT_OUT WHEEL_DIR LOG_NAME: makes $out, unpacks the carried wheels of WHEEL_DIR onto
# PYTHONPATH (the device machine has no package index; the folder is $gpu_site), sets $log and
# writes the machine header.
gpu_setup() {
  out=${OUT:-$1}
  mkdir -p "$out"
  local w
  gpu_site=$(mktemp -d /tmp/gpu_site.XXXX)  # the caller removes it when done
  for w in "$2"/*.whl; do
    [ -e "$w" ] && python3 -m zipfile -e "$w" "$gpu_site"
  done
  export PYTHONPATH="$PWD:$gpu_site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  log="$out/$3"
  {
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    python3 -c "import torch; print('torch', torch.__version__)"
    ls "$2" 2>/dev/null
  } 2>&1 | tee "$log"
}
