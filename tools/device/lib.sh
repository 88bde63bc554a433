# Sourced by the tools/device/*.sh scripts: what they share. The Debian packages a build needs, found installed
# or taken from .deb files carried to a machine without a network (unpacked into a private prefix, never into /),
# the commit of the tree, and a Release build of one target.

# Downloads the named Debian packages' .deb files into DIR (on a machine with apt).
devdeps_fetch() {
  local dir=$1
  shift
  mkdir -p "$dir"
  (cd "$dir" && apt-get download "$@")
  ls -l "$dir"
}

# Prints each named CMake package that find_package cannot find.
devdeps_missing() {
  local dir
  dir=$(mktemp -d)
  cat >"$dir/CMakeLists.txt" <<CMAKE
cmake_minimum_required(VERSION 3.16)
project(markbase_deps_probe CXX)
foreach(p $*)
  find_package(\${p} QUIET)
  if(NOT \${p}_FOUND)
    message(STATUS "MB_MISSING \${p}")
  endif()
endforeach()
CMAKE
  cmake -S "$dir" -B "$dir/b" 2>&1 | sed -n 's/.*MB_MISSING //p'
  rm -rf "$dir"
}

# Unpacks every DIR/*.deb into PREFIX and points CMake and the loader at it.
devdeps_unpack() {
  local dir=$1 prefix=$2 d member z
  rm -rf "$prefix" && mkdir -p "$prefix"
  for d in "$dir"/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$d" "$prefix"
    else  # a .deb is an ar archive whose data.tar.* holds the files
      member=$(ar t "$d" | grep '^data\.tar')
      case $member in *.xz) z=-J ;; *.zst) z=--zstd ;; *.gz) z=-z ;; *) z= ;; esac
      ar p "$d" "$member" | tar -x $z -C "$prefix" -f -
    fi
  done
  export CMAKE_PREFIX_PATH=$prefix/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}
  export LD_LIBRARY_PATH=$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # Packages found through pkg-config (cpp-httplib) rather than a CMake config file: the prefix's own .pc files
  # only (their paths say /usr: the sysroot maps them into the prefix), and pkg-config itself when carried.
  export PKG_CONFIG_LIBDIR=$prefix/usr/lib/x86_64-linux-gnu/pkgconfig:$prefix/usr/share/pkgconfig
  export PKG_CONFIG_SYSROOT_DIR=$prefix
  export PATH=$PATH:$prefix/usr/bin
}

# The commit of the tree at ROOT. A COMMIT file wins: the copy of the tree a device call gets may carry a stale .git.
device_commit() {
  local root=$1 commit=unknown
  if [[ -f $root/COMMIT ]]; then
    commit="$(head -n 1 "$root/COMMIT") (from COMMIT)"
  elif git -C "$root" rev-parse HEAD >/dev/null 2>&1; then
    commit=$(git -C "$root" rev-parse HEAD)
    if [[ -n $(git -C "$root" status --porcelain --untracked-files=no 2>/dev/null) ]]; then
      commit+=" (with uncommitted changes)"
    fi
  fi
  echo "$commit"
}

# Configures ROOT as a Release build in BUILD (Ninja where present; no benchmarks, no CUDA; the other arguments
# go to cmake) and builds TARGET, its output in LOG. A BUILD configured from another source path (a copy of the
# tree elsewhere) cannot be reused: it is removed first.
device_build() {
  local root=$1 build=$2 target=$3 log=$4
  shift 4
  if [[ -f $build/CMakeCache.txt ]] && ! grep -qx "CMAKE_HOME_DIRECTORY:INTERNAL=$root" "$build/CMakeCache.txt"; then
    rm -rf "$build"
  fi
  local gen=(-G "Unix Makefiles")
  command -v ninja >/dev/null && gen=(-G Ninja)
  { cmake -S "$root" -B "$build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DMARKBASE_BENCH=OFF -DMARKBASE_CUDA=OFF "$@" &&
      cmake --build "$build" --target "$target" -j "${JOBS:-$(nproc)}"; } >"$log" 2>&1
}
