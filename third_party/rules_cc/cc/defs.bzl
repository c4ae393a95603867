"""Offline stand-in for @rules_cc//cc:defs.bzl.

Debian's rules_cc is too new for Bazel 4.2.3, and the build must not download anything, so this
file re-exports the C++ rules that are built into Bazel under the names rules_cc uses.
"""

def cc_binary(**kwargs):
    native.cc_binary(**kwargs)

def cc_library(**kwargs):
    native.cc_library(**kwargs)

def cc_test(**kwargs):
    native.cc_test(**kwargs)

def cc_import(**kwargs):
    native.cc_import(**kwargs)

def cc_proto_library(**kwargs):
    native.cc_proto_library(**kwargs)

def cc_toolchain(**kwargs):
    native.cc_toolchain(**kwargs)

def cc_toolchain_suite(**kwargs):
    native.cc_toolchain_suite(**kwargs)

def fdo_prefetch_hints(**kwargs):
    native.fdo_prefetch_hints(**kwargs)

def fdo_profile(**kwargs):
    native.fdo_profile(**kwargs)

def objc_library(**kwargs):
    native.objc_library(**kwargs)

def objc_import(**kwargs):
    native.objc_import(**kwargs)
