"""A repository rule that finds LibTorch on this machine (no download).

Which LibTorch:
  - GPIPE_LIBTORCH unset: Debian's system LibTorch (`apt-get install libtorch-dev`), headers in
    /usr/include and libraries in /usr/lib/<multiarch>.
  - GPIPE_LIBTORCH=/path: a LibTorch distribution folder or a PyTorch install's `torch/` folder;
    either has `include/` and `lib/`. If `lib/` holds libtorch_cuda.so the build is CUDA-enabled:
    the CUDA libraries are linked with --no-as-needed (otherwise the linker drops them, nothing
    registers the CUDA backend, and torch::cuda::is_available() silently says false), and the
    CUDA Toolkit's headers and runtime are taken from CUDA_HOME (default /usr/local/cuda).

The generated repository has one target, @libtorch//:libtorch, and a file @libtorch//:config.bzl
with LIBTORCH_CUDA = True/False, LIBTORCH_CXX_STANDARD ("17" or "20"), GPIPE_COPTS (the
-std= flag every gpipe rule compiles with), and HAS_DISTRIBUTED / DISTRIBUTED_TAGS (whether
gpipe/distributed can be built: Gloo's headers found, and GPIPE_DISTRIBUTED not 0; its targets
are tagged manual otherwise). The standard is the lowest one the LibTorch's headers
accept: C++17, or C++20 for the LibTorch versions whose headers refuse anything older (their
c10/util/C++17.h, ATen/ATen.h or torch/all.h test `__cplusplus < 202002L`). GPIPE_CXX_STANDARD=20
(or 17, 23) overrides it.
"""

_SYSTEM_INCLUDE = "/usr/include"
_SYSTEM_LIBDIRS = ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib"]

def _find_system_libdir(rctx):
    for d in _SYSTEM_LIBDIRS:
        if rctx.path(d + "/libtorch.so").exists:
            return d
    fail("gpipe: no LibTorch found. Install Debian's (`tools/setup.sh` or `apt-get install " +
         "libtorch-dev`) or set GPIPE_LIBTORCH to a LibTorch folder that has include/ and lib/.")

def _uses_old_abi(rctx, root):
    config = rctx.path(root + "/share/cmake/Torch/TorchConfig.cmake")
    if not config.exists:
        return False
    return "_GLIBCXX_USE_CXX11_ABI=0" in rctx.read(config)

def _cxx_standard(rctx, include_dir):
    chosen = rctx.os.environ.get("GPIPE_CXX_STANDARD", "")
    if chosen:
        if chosen not in ["17", "20", "23"]:
            fail("gpipe: GPIPE_CXX_STANDARD=%s; use 17, 20 or 23" % chosen)
        return chosen
    for header in ["c10/util/C++17.h", "ATen/ATen.h", "torch/csrc/api/include/torch/all.h"]:
        path = rctx.path(include_dir + "/" + header)
        if path.exists and "__cplusplus < 202002L" in rctx.read(path):
            return "20"
    return "17"

def _libtorch_repository_impl(rctx):
    root = rctx.os.environ.get("GPIPE_LIBTORCH", "").rstrip("/")

    # LibTorch's release builds are compiled with NDEBUG, and some of its headers lay out classes
    # differently without it (at::RecordFunction has a debug-only member), so everything that
    # includes them must define it too, in debug and sanitizer builds as well.
    defines = ["NDEBUG"]
    if root:
        for sub in ["include", "lib"]:
            if not rctx.path(root + "/" + sub).exists:
                fail("gpipe: GPIPE_LIBTORCH=%s has no %s/ folder; point it at a LibTorch " % (root, sub) +
                     "distribution or a PyTorch install's torch/ folder (both have include/ and lib/).")
        rctx.symlink(root + "/include", "include")
        libdir = root + "/lib"
        hdrs = 'glob(["include/**"], allow_empty = True)'
        includes = ["include", "include/torch/csrc/api/include"]
        if _uses_old_abi(rctx, root):
            defines.append("_GLIBCXX_USE_CXX11_ABI=0")
    else:
        libdir = _find_system_libdir(rctx)

        # /usr/include is a compiler built-in search path; only the C++ frontend's folder is extra.
        rctx.symlink(_SYSTEM_INCLUDE + "/torch/csrc/api/include", "api_include")
        hdrs = 'glob(["api_include/**"], allow_empty = True)'
        includes = ["api_include"]

    cuda = rctx.path(libdir + "/libtorch_cuda.so").exists
    linkopts = ["-L" + libdir, "-Wl,-rpath," + libdir, "-Wl,--no-as-needed", "-ltorch", "-ltorch_cpu", "-lc10"]
    if cuda:
        # The CUDA runtime's headers (c10/cuda includes cuda_runtime_api.h). gpipe calls no CUDA
        # function itself, so nothing beyond LibTorch's own libraries is linked: a PyTorch install
        # without a CUDA Toolkit works, with the headers of its nvidia-cuda-runtime wheel.
        cuda_home = rctx.os.environ.get("CUDA_HOME", "/usr/local/cuda").rstrip("/")
        candidates = [cuda_home, "/usr"]  # /usr: Debian's nvidia-cuda-dev
        if root:
            site = root.rsplit("/", 1)[0]
            candidates += [site + "/nvidia/cuda_runtime", site + "/nvidia/cu13", site + "/nvidia/cu12"]
        cuda_root = None
        for c in candidates:
            if rctx.path(c + "/include/cuda_runtime_api.h").exists:
                cuda_root = c
                break
        if not cuda_root:
            fail("gpipe: %s/lib/libtorch_cuda.so is CUDA-enabled, but the CUDA runtime's headers " % root +
                 "(include/cuda_runtime_api.h) are in none of %s. Set CUDA_HOME to the " % candidates +
                 "CUDA Toolkit folder, or install PyTorch's nvidia-cuda-runtime wheel.")
        if cuda_root != "/usr":  # /usr/include is searched by the compiler anyway
            rctx.symlink(cuda_root + "/include", "cuda_include")
            includes.append("cuda_include")
            hdrs = hdrs[:-1] + ' + glob(["cuda_include/**"], allow_empty = True))'
        linkopts += ["-ltorch_cuda", "-lc10_cuda"]
        defines.append("GPIPE_WITH_CUDA=1")
    linkopts += ["-Wl,--as-needed", "-lpthread"]

    rctx.file("BUILD", """# Generated by //third_party/libtorch:libtorch.bzl. LibTorch libraries: {libdir}
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "libtorch",
    hdrs = {hdrs},
    includes = {includes},
    defines = {defines},
    linkopts = {linkopts},
)
""".format(libdir = libdir, hdrs = hdrs, includes = includes, defines = defines, linkopts = linkopts))
    standard = _cxx_standard(rctx, (root + "/include") if root else _SYSTEM_INCLUDE)

    # gpipe/distributed includes LibTorch's c10d headers, which include Gloo's (gloo/algorithm.h):
    # Debian's libgloo-dev, or a LibTorch folder that has them. Without them (or with
    # GPIPE_DISTRIBUTED=0) the distributed targets are tagged manual and `bazel build //...`
    # leaves them out.
    gloo = (rctx.path(_SYSTEM_INCLUDE + "/gloo/algorithm.h").exists or
            (root and rctx.path(root + "/include/gloo/algorithm.h").exists))
    wanted = rctx.os.environ.get("GPIPE_DISTRIBUTED", "auto")
    if wanted not in ["auto", "0", "1"]:
        fail("gpipe: GPIPE_DISTRIBUTED=%s; use auto (the default), 1 or 0" % wanted)
    if wanted == "1" and not gloo:
        fail("gpipe: GPIPE_DISTRIBUTED=1, but Gloo's headers (gloo/algorithm.h), which LibTorch's " +
             "c10d headers include, are in neither /usr/include nor the LibTorch's include/: " +
             "install them (Debian: libgloo-dev)")
    has_gloo = bool(gloo) and wanted != "0"
    if not has_gloo:
        print("gpipe: gpipe/distributed, its tests and benchmarks and the trainers' --distributed " +
              "are left out (" + ("GPIPE_DISTRIBUTED=0" if wanted == "0" else
                                  "no Gloo headers, gloo/algorithm.h: install libgloo-dev") + ")")
    rctx.file("config.bzl", "\n".join([
        "LIBTORCH_CUDA = %s" % cuda,
        "HAS_DISTRIBUTED = %s" % has_gloo,
        "DISTRIBUTED_TAGS = %s" % ([] if has_gloo else ["manual"]),
        "LIBTORCH_LIBDIR = %r" % libdir,
        "LIBTORCH_CXX_STANDARD = %r" % standard,
        "GPIPE_COPTS = [%r, \"-Wall\", \"-Wextra\"]" % ("-std=c++" + standard),
        "",
    ]))

libtorch_repository = repository_rule(
    implementation = _libtorch_repository_impl,
    environ = ["GPIPE_LIBTORCH", "CUDA_HOME", "GPIPE_CXX_STANDARD", "GPIPE_DISTRIBUTED"],
    local = True,
)
