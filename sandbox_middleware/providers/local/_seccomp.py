"""The seccomp filter of LocalProvider's bwrap commands: a classic-BPF program, per architecture.

bwrap installs it from a memfd (``--add-seccomp-fd``, see ``_bwrap.py``); on an architecture not
listed here there is none (``mechanisms`` says so).
"""

from __future__ import annotations

import platform
import struct

__all__ = ["seccomp_program"]

# seccomp: syscalls denied with EPERM, per architecture (audit arch, numbers). The kernel keyrings
# are shared by uid and inherited from the trainer's session; the rest only widen the attack surface.
_DENIED = {
    "x86_64": (
        0xC000003E,
        # add_key request_key keyctl bpf perf_event_open userfaultfd io_uring_{setup,enter,register}
        # kexec_load kexec_file_load init_module finit_module delete_module
        (248, 249, 250, 321, 298, 323, 425, 426, 427, 246, 320, 175, 313, 176),
        (41, 53),  # socket, socketpair: refused for AF_VSOCK, which no network namespace covers
    ),
    "aarch64": (0xC00000B7, (217, 218, 219, 280, 241, 282, 425, 426, 427, 104, 294, 105, 273, 106), (198, 199)),
}
_AF_VSOCK = 40
_X32_SYSCALL_BIT = 0x40000000


def seccomp_program() -> bytes | None:
    """A classic-BPF seccomp filter denying ``_DENIED`` (and any other ABI) with EPERM; None if unknown arch."""
    arch = _DENIED.get(platform.machine())
    if arch is None:
        return None
    audit_arch, numbers, sockets = arch
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    deny, allow = 0x00050000 | 1, 0x7FFF0000  # SECCOMP_RET_ERRNO | EPERM, SECCOMP_RET_ALLOW
    tail = [  # the last four instructions: index from the end
        (ld, 0, 0, 16),  # -4 "family": seccomp_data.args[0], its low 32 bits
        (jeq, 1, 0, _AF_VSOCK),  # -3
        (ret, 0, 0, allow),  # -2
        (ret, 0, 0, deny),  # -1 "deny"
    ]
    head = [
        (ld, 0, 0, 4),  # seccomp_data.arch
        (jeq, 1, 0, audit_arch),
        (ret, 0, 0, deny),  # another ABI (i386, x32 ...): nothing of it is allowed
        (ld, 0, 0, 0),  # seccomp_data.nr
    ]
    checks = [
        (_X32_SYSCALL_BIT, jge, "deny"),
        *((n, jeq, "deny") for n in numbers),
        *((n, jeq, "family") for n in sockets),
    ]
    body = [*checks, None]  # None: allow
    program = list(head)
    for index, check in enumerate(body):
        if check is None:
            program.append((ret, 0, 0, allow))
            continue
        value, op, target = check
        after = len(body) - index - 1  # instructions of the body after this one
        program.append((op, after + (len(tail) - 1 if target == "deny" else 0), 0, value))
    program += tail
    return b"".join(struct.pack("=HBBI", *instruction) for instruction in program)
