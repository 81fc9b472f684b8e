"""The gVisor engine: the box runs in ``runsc``'s user-space kernel, not in a VM.

Not hardware isolation: the boundary is gVisor's Sentry (a Go kernel that
intercepts every system call) and its seccomp filters, at near-native CPU speed
where KVM is not usable. The same static agent runs as the container's init.
"""

from .engine import GvisorEngine

__all__ = ["GvisorEngine"]
