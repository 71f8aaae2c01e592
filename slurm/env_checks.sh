# shellcheck shell=bash
# Checks of the environment variables the slurm/ scripts read, sourced by each of them before it
# uses any: a value that cannot work (a word where a number goes, a VENV that does not exist, a choice
# that is none of the choices) is one line, `megatron-rl: NAME ...`, on stderr, and the caller stops
# with exit status 2 (`mrl_env_ok || exit 2`), as every megatron-rl entry point does.
#
#   mrl_need_int NAME MIN [MAX]       NAME, when set, is a whole number in [MIN, MAX]
#   mrl_need_number NAME              NAME, when set, is a number > 0 (e.g. 0.5)
#   mrl_need_choice NAME CHOICE...    NAME, when set, is one of the choices
#   mrl_need_dir NAME [WHAT]          NAME, when set, is an existing directory
#   mrl_need_file NAME                NAME, when set, is an existing file
#   mrl_need_dir_path NAME            NAME, when set, is a directory or can be made one (no file in its way)
#   mrl_need_venv                     VENV, when set, is a virtualenv (bin/activate, bin/python)
#   mrl_need_words NAME               NAME, when set, holds no characters a host list cannot
#   mrl_env_ok                        0 when no check above failed since the last call (then resets)
# An empty variable counts as unset (its default applies), as the scripts read them.

_mrl_env_bad=0

_mrl_refuse() {  # one line; only the first refusal is printed (one line per run)
  [ "$_mrl_env_bad" = 0 ] && echo "megatron-rl: $*" >&2
  _mrl_env_bad=1
}

mrl_need_int() {
  local name="$1" min="$2" max="${3:-}" value
  [ -n "${!name:-}" ] || return 0
  value="${!name}"
  if ! [[ "$value" =~ ^[0-9]+$ ]] || [ "${#value}" -gt 12 ]; then
    _mrl_refuse "$name must be a whole number >= $min${max:+ and <= $max}, got '$value'"; return 1
  fi
  if (( 10#$value < min )) || { [ -n "$max" ] && (( 10#$value > max )); }; then
    _mrl_refuse "$name must be >= $min${max:+ and <= $max}, got $value"; return 1
  fi
}

mrl_need_number() {
  local name="$1" value
  [ -n "${!name:-}" ] || return 0
  value="${!name}"
  if ! [[ "$value" =~ ^[0-9]+([.][0-9]+)?$ ]] || [[ "$value" =~ ^0+([.]0+)?$ ]]; then
    _mrl_refuse "$name must be a number > 0 (seconds), got '$value'"; return 1
  fi
}

mrl_need_choice() {
  local name="$1" value c
  shift
  [ -n "${!name:-}" ] || return 0
  value="${!name}"
  for c in "$@"; do [ "$value" = "$c" ] && return 0; done
  _mrl_refuse "$name must be $(printf '%s or ' "$@" | sed 's/ or $//'), got '$value'"; return 1
}

mrl_need_dir() {
  local name="$1" what="${2:-directory}" value
  [ -n "${!name:-}" ] || return 0
  value="${!name}"
  [ -d "$value" ] || { _mrl_refuse "$name: no such $what: $value"; return 1; }
}

mrl_need_dir_path() {
  local name="$1" value here
  [ -n "${!name:-}" ] || return 0
  value="${!name}"
  here="$value"
  while [ ! -e "$here" ] && [ "$here" != "$(dirname "$here")" ]; do here="$(dirname "$here")"; done
  if [ -e "$here" ] && [ ! -d "$here" ]; then
    _mrl_refuse "$name: cannot be a directory: $here is a file (${name}=$value)"; return 1
  fi
}

mrl_need_file() {
  local name="$1" value
  [ -n "${!name:-}" ] || return 0
  value="${!name}"
  [ -f "$value" ] || { _mrl_refuse "$name: no such file: $value"; return 1; }
}

mrl_need_venv() {
  [ -n "${VENV:-}" ] || return 0
  if [ ! -d "$VENV" ]; then _mrl_refuse "VENV: no such virtualenv directory: $VENV"; return 1; fi
  if [ ! -f "$VENV/bin/activate" ] || [ ! -x "$VENV/bin/python" ]; then
    _mrl_refuse "VENV: $VENV is not a virtualenv (no bin/activate and bin/python in it)"; return 1
  fi
}

mrl_need_words() {
  local name="$1" value
  [ -n "${!name:-}" ] || return 0
  value="${!name}"
  if [ -z "${value//[, ]/}" ] || [[ "$value" =~ [^A-Za-z0-9.,_\ -] ]]; then
    _mrl_refuse "$name must be host names separated by commas or spaces, got '$value'"; return 1
  fi
}

mrl_env_ok() {
  local bad="$_mrl_env_bad"
  _mrl_env_bad=0
  [ "$bad" = 0 ]
}
