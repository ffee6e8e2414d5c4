#!/usr/bin/env bash
# Checks that each crate under vendor/ is its crates.io release plus its patch file and nothing
# else (issue 42): an edit to a copy that vendor/<crate>/sluice.patch does not carry, or a copy
# left behind by a version bump, fails here instead of going unnoticed.
#
#   scripts/vendor-check.sh                    check every crate vendor/VENDORED lists
#   scripts/vendor-check.sh --regen            rewrite each vendor/<crate>/sluice.patch from the
#                                              copy as it is now (after an intended change)
#   scripts/vendor-check.sh --vendor-dir DIR   the same for another vendor tree (the tests use a
#                                              tampered copy)
#
# vendor/VENDORED has one line per crate, "name version sha256", the sha256 of the .crate file
# as crates.io serves it (the "cksum" of its index entry). For each line the script takes the
# .crate from cargo's download cache ($CARGO_HOME/registry/cache/*/name-version.crate) or from
# its own ($VENDOR_CHECK_CACHE, default target/vendor-check/), else downloads
# https://static.crates.io/crates/name/name-version.crate into its own; refuses a file whose
# sha256 differs; extracts it; removes the package files Sluice does not vendor (below); applies
# vendor/<crate>/sluice.patch with `patch -p1 --fuzz=0`; and compares the result, file by file
# and byte for byte (contents, not modes), with vendor/<crate>/, naming every file that differs,
# is missing or is extra.
# Both of the package's manifests are compared as they are: Cargo.toml (normalized by
# `cargo package`, the one cargo reads) and Cargo.toml.orig (the repository's).
#
# Sluice's own files in vendor/<crate>/ (top level only), not compared:
#   SLUICE-PATCH.md   why the patch exists, what it buys, how to drop it
#   sluice.patch      the patch: a commit-message header (upstream proposal), then the unified
#                     diff against the package; a last section on Cargo.toml, if any, is
#                     Sluice's vendoring only (upstream's manifest is Cargo.toml.orig)
# and vendor/VENDORED itself.
#
# Package files Sluice does not vendor (removed from the package before the patch; the copy must
# not have them either):
#   .cargo_vcs_info.json, Cargo.lock   `cargo package` bookkeeping; a dependency's lock is unused
#   examples/, benches/                not built for a dependency (the patch drops their entries
#                                      and the dev-dependencies from Cargo.toml)
#
# Needs bash, tar, gzip, GNU patch and diffutils, sha256sum (or shasum), and curl (or wget) when
# the .crate is in neither cache. Exit status 0: every copy matches; 1: a difference; 2: usage
# or an error on the way (download, checksum, extraction).
set -euo pipefail
shopt -s inherit_errexit

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OWN_FILES=(SLUICE-PATCH.md sluice.patch)
NOT_VENDORED=(.cargo_vcs_info.json Cargo.lock examples benches)
# Written before a patch's Cargo.toml section (regenerated as is by --regen).
MANIFEST_NOTE="Sluice vendoring only, not for upstream: crates.io's normalized Cargo.toml, which
\`cargo package\` generates from the repository's manifest (here Cargo.toml.orig). Leave it out
upstream with \`git apply --exclude=<crate>/Cargo.toml\`."

vendor_dir="$ROOT/vendor"
regen=0
usage() { sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
  case "$1" in
    --regen) regen=1 ;;
    --vendor-dir) [ $# -ge 2 ] || { usage >&2; exit 2; }; vendor_dir="$2"; shift ;;
    --vendor-dir=*) vendor_dir="${1#--vendor-dir=}" ;;
    -h|--help) usage; exit 0 ;;
    *) echo "vendor-check: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
say() { printf 'vendor-check: %s\n' "$*"; }
die() { printf 'vendor-check: %s\n' "$*" >&2; exit 2; }
vendor_dir="$(cd "$vendor_dir" 2>/dev/null && pwd)" || die "no directory $vendor_dir"
manifest="$vendor_dir/VENDORED"
[ -f "$manifest" ] || die "$manifest is missing (lines: name version sha256)"
for tool in tar patch diff cmp; do
  command -v "$tool" >/dev/null || die "needs '$tool' (Debian: apt-get install ${tool/cmp/diffutils})"
done
sha256() {
  if command -v sha256sum >/dev/null; then sha256sum "$1" | cut -d' ' -f1
  else shasum -a 256 "$1" | cut -d' ' -f1; fi
}

cache_dir="${VENDOR_CHECK_CACHE:-${CARGO_TARGET_DIR:-$ROOT/target}/vendor-check}"
work="$(mktemp -d "${TMPDIR:-/tmp}/vendor-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT

# fetch NAME VERSION SHA256: prints the path of a .crate file with that sha256. A cached file
# with another sha256 is passed over (cargo's) or downloaded again (ours).
fetch() {
  local name=$1 version=$2 want=$3 file got f
  file="$name-$version.crate"
  for f in "${CARGO_HOME:-$HOME/.cargo}"/registry/cache/*/"$file" "$cache_dir/$file"; do
    [ -f "$f" ] || continue
    got="$(sha256 "$f")"
    if [ "$got" = "$want" ]; then echo "$f"; return; fi
    say "$f has sha256 $got, not the pinned $want: not using it" >&2
  done
  mkdir -p "$cache_dir"
  local url="https://static.crates.io/crates/$name/$file" part="$cache_dir/$file.$$.part"
  if command -v curl >/dev/null; then
    curl -sSfL --retry 3 -o "$part" "$url" || { rm -f "$part"; die "could not download $url"; }
  elif command -v wget >/dev/null; then
    wget -q -O "$part" "$url" || { rm -f "$part"; die "could not download $url"; }
  else
    die "$file is in no cache and neither curl nor wget is installed"
  fi
  got="$(sha256 "$part")"
  if [ "$got" != "$want" ]; then
    rm -f "$part"
    die "$url has sha256 $got, but $manifest pins $want for $name $version"
  fi
  mv -f "$part" "$cache_dir/$file"
  echo "$cache_dir/$file"
}

# files DIR [own]: the regular files and symlinks under DIR, relative, sorted; with "own",
# without Sluice's own top-level files.
files() {
  (cd "$1" && find . \( -type f -o -type l \) -print | sed 's|^\./||' | LC_ALL=C sort) |
    if [ "${2:-}" = own ]; then grep -v -x -F "${OWN_FILES[@]/#/-e}" || true; else cat; fi
}

# diff_file A B REL: a unified diff of REL from A to B, labelled a/REL and b/REL (or /dev/null).
diff_file() {
  local a="$1/$3" b="$2/$3" la="a/$3" lb="b/$3" rc=0
  [ -e "$a" ] || { a=/dev/null; la=/dev/null; }
  [ -e "$b" ] || { b=/dev/null; lb=/dev/null; }
  LC_ALL=C diff -u --label "$la" --label "$lb" "$a" "$b" || rc=$?
  [ "$rc" -le 1 ] || die "diff failed on $3"
}

# pristine NAME VERSION SHA256: extracts the verified package, less the files not vendored,
# and prints its directory.
pristine() {
  local name=$1 version=$2 crate dir
  crate="$(fetch "$@")"
  dir="$work/$name/pristine"
  mkdir -p "$dir"
  tar -xzf "$crate" -C "$dir" --no-same-owner || die "could not extract $crate"
  [ -d "$dir/$name-$version" ] || die "$crate has no $name-$version/ directory"
  local f
  for f in "${NOT_VENDORED[@]}"; do rm -rf "${dir:?}/$name-$version/$f"; done
  echo "$dir/$name-$version"
}

# The patch file's text before its first file diff: the commit message.
patch_header() {
  awk '/^--- (a\/|\/dev\/null)/ { exit } { print }' "$1"
}

failed=()
checked=0
declare -A listed=()
while read -r name version want rest <&3; do
  case "$name" in ''|'#'*) continue ;; esac
  [ -n "$version" ] && [ -n "$want" ] && [ -z "$rest" ] ||
    die "VENDORED: bad line '$name $version $want $rest' (want: name version sha256)"
  [[ "$want" =~ ^[0-9a-f]{64}$ ]] || die "VENDORED: $name: '$want' is not a sha256"
  listed[$name]=1
  copy="$vendor_dir/$name"
  patchfile="$copy/sluice.patch"
  if [ ! -d "$copy" ]; then
    say "$name $version: FAIL: VENDORED lists it but $copy is missing"
    failed+=("$name"); continue
  fi
  base="$(pristine "$name" "$version" "$want")"

  if [ "$regen" = 1 ]; then
    header="$work/$name/header"
    if [ -f "$patchfile" ]; then
      patch_header "$patchfile" > "$header"
    else
      printf '%s: <subject>\n\n<body: what it does, why, what it buys>\n\n---\n' "$name" \
        > "$header"
    fi
    body="$work/$name/body"
    : > "$body"
    n=0
    while read -r rel; do
      [ "$rel" = Cargo.toml ] && continue
      if ! cmp -s "$base/$rel" "$copy/$rel" 2>/dev/null; then
        out="$(diff_file "$base" "$copy" "$rel")"
        case "$out" in
          "Binary files"*) die "$name: $rel differs and is binary: a patch file cannot carry it" ;;
        esac
        printf '%s\n' "$out" >> "$body"
        n=$((n + 1))
      fi
    done < <( { files "$base"; files "$copy" own; } | LC_ALL=C sort -u)
    if [ -f "$copy/Cargo.toml" ] && ! cmp -s "$base/Cargo.toml" "$copy/Cargo.toml"; then
      printf '\n%s\n\n' "$MANIFEST_NOTE" >> "$body"
      diff_file "$base" "$copy" Cargo.toml >> "$body"
      n=$((n + 1))
    fi
    cat "$header" "$body" > "$work/$name/patch"
    if cmp -s "$work/$name/patch" "$patchfile"; then
      say "$name $version: ${patchfile#"$ROOT"/} unchanged ($n file(s) differ from the package)"
    else
      cp "$work/$name/patch" "$patchfile"
      say "$name $version: wrote ${patchfile#"$ROOT"/} ($n file(s) differ from the package)"
    fi
  fi

  # Apply the patch to the package and compare with the copy.
  expected="$work/$name/expected"
  cp -a "$base" "$expected"
  if [ ! -f "$patchfile" ]; then
    say "$name $version: FAIL: $patchfile is missing (--regen writes it)"
    failed+=("$name"); continue
  fi
  if grep -q -E '^--- (a/|/dev/null)' "$patchfile"; then
    if ! out="$(cd "$expected" && patch -p1 --batch --forward --fuzz=0 --no-backup-if-mismatch \
      -r - -i "$patchfile" 2>&1)"; then
      say "$name $version: FAIL: $patchfile does not apply to crates.io $name $version:"
      printf '%s\n' "$out" | sed 's/^/    /'
      failed+=("$name"); continue
    fi
  fi
  bad=()
  while read -r rel; do
    if [ ! -e "$copy/$rel" ] && [ ! -L "$copy/$rel" ]; then
      bad+=("  missing from the copy: $name/$rel")
    elif [ ! -e "$expected/$rel" ] && [ ! -L "$expected/$rel" ]; then
      bad+=("  only in the copy:      $name/$rel")
    elif ! cmp -s "$expected/$rel" "$copy/$rel"; then
      bad+=("  differs:               $name/$rel")
    fi
  done < <( { files "$expected"; files "$copy" own; } | LC_ALL=C sort -u)
  if [ ${#bad[@]} -gt 0 ]; then
    say "$name $version: FAIL: $copy is not crates.io $name $version + sluice.patch:"
    printf '%s\n' "${bad[@]}"
    for line in "${bad[@]}"; do
      case "$line" in *differs:*)
        rel="${line##* "$name"/}"
        echo "  --- what sluice.patch gives, +++ the copy ($rel, first 40 lines):"
        diff_file "$expected" "$copy" "$rel" | head -n 40 | sed 's/^/    /' || true ;;
      esac
    done
    failed+=("$name"); continue
  fi
  say "$name $version: ok (sha256 $want, $(grep -c -E '^\+\+\+ ' "$patchfile" || true) file(s) patched)"
  checked=$((checked + 1))
done 3< "$manifest"

# A vendored directory VENDORED does not list is a copy nothing checks.
for d in "$vendor_dir"/*/; do
  [ -d "$d" ] || continue
  d="$(basename "$d")"
  if [ -z "${listed[$d]:-}" ]; then
    say "$d: FAIL: $vendor_dir/$d is not in VENDORED, so nothing checks it"
    failed+=("$d")
  fi
done

if [ ${#failed[@]} -gt 0 ]; then
  say "FAILED: ${failed[*]} (for an intended change: scripts/vendor-check.sh --regen, review" \
    "the patch, explain it in SLUICE-PATCH.md)" >&2
  exit 1
fi
say "all $checked vendored crates are their crates.io release + sluice.patch"
