#!/usr/bin/env bash
# Sourced by scripts/run.sh and scripts/test.sh: makes sure the C toolchain Pingora's build needs
# is present. Pingora's compression crates build zlib-ng with CMake and zstd with a C compiler;
# a machine with only the Rust toolchain has neither CMake nor, sometimes, cc.
#   ensure_build_deps       installs what is missing: Debian's packages when root or sudo can,
#                           otherwise CMake from PyPI into the user's site (no root needed).
ensure_build_deps() {
  local sudo="" missing=()
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  command -v cmake >/dev/null 2>&1 || missing+=(cmake)
  command -v cc >/dev/null 2>&1 || missing+=(gcc)
  command -v make >/dev/null 2>&1 || missing+=(make)
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ -z "$sudo" ] || sudo -n true 2>/dev/null; then
    printf '== installing %s (needed to build Pingora)\n' "${missing[*]}" >&2
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null
  elif [ "${missing[*]}" = "cmake" ] && command -v python3 >/dev/null 2>&1; then
    printf '== installing cmake from PyPI into ~/.local (no root)\n' >&2
    python3 -m pip install -q --user cmake
    export PATH="$HOME/.local/bin:$PATH"
  else
    printf 'missing %s and no root to install them: install them, then run this again\n' \
      "${missing[*]}" >&2
    return 1
  fi
}
