"""Who may depend on gpipe's internal targets (//gpipe:internal, //gpipe/distributed:internal,
//balancing:internal): gpipe's own packages, never a user's."""

GPIPE_PACKAGES = [
    "//balancing:__subpackages__",
    "//benchmarks:__subpackages__",
    "//examples:__subpackages__",
    "//gpipe:__subpackages__",
    "//tests:__subpackages__",
]
