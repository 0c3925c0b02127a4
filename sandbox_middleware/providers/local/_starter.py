"""The command starter: one long-lived process per bwrap sandbox that starts each of its commands.

The provider launches it once, at create, exactly as a command used to be launched (its cgroups
joined, its rlimits and ``oom_score_adj`` set, ``setpriv`` to the sandbox's uid, bwrap with every
namespace and the seccomp filter), and from then on each ``exec`` is a message to it instead of a
new ``sh`` -> ``setpriv`` -> ``bwrap`` chain and a cgroup attach. bwrap gives it three capabilities
inside the sandbox's own user namespace, ``CAP_SYS_ADMIN``, ``CAP_SETPCAP`` and ``CAP_NET_ADMIN``,
which no command ever holds:

- Every command gets fresh PID, mount, network, IPC and UTS namespaces of its own, as each bwrap
  run gave it. A *command init* (PID 1 there, as bwrap's init was) mounts a new ``/proc`` (covering
  ``sys``, ``sysrq-trigger``, ``irq`` and ``bus`` read-only where writable, as bwrap does), brings
  up ``lo``, raises its ``oom_score_adj`` above the starter's, drops every capability (bounding,
  ambient, effective, permitted, inheritable) and becomes non-dumpable; then it starts the command
  (PID 2: its own session and process group, stdin ``/dev/null``, stdout and stderr the provider's
  pipes, the environment and cwd the provider sent, the signal dispositions Python changed reset).
  When the command exits, the init answers the provider with its status (``128 + signal`` for a
  signal, as bwrap reported it) and exits, and the kernel kills whatever the command left behind:
  nothing outlives its command. A timeout (or a cancelled call) kills the init, hence the whole
  namespace, ``setsid`` children included.
- Inits are made ahead, one spare at a time: once the last command ended, or, when commands come
  back to back, while one runs; a command then costs one message to the starter, one to its init
  and one ``posix_spawn``.
- A plain ``bash -c`` command (plain words, a program bash would exec in its own place, an
  environment bash passes on as it came) is started by the init as bash would exec it, without
  bash's start (``direct_command``); anything else is bash's, as before.
- Commands cannot reach the starter: it lives in a PID namespace they cannot see (so they can
  neither signal nor ptrace it), it is non-dumpable, and none of its descriptors reaches a command.
  Each command's result travels on a socket pair of its own, made by the provider and held by the
  starter and that command's init alone, so nothing can answer for another command.
- The provider holds the other end of the control socket: when it goes, the starter exits and
  bwrap's init takes every process of the sandbox with it.

This file runs under the sandbox's own Python (3.9 or newer, whichever the provider found in the
sandbox's view), with ``-I -S``, from a memfd: the standard library's C modules only, and no
import from this package. The provider imports its protocol half (``encode_spec``, the message
bytes, ``returncode``).
"""

from __future__ import annotations

import _ctypes  # ctypes' C half: the package's import is most of the starter's own start-up
import _signal  # type: ignore[import-not-found]  # signal's C half: no enum import at start
import _socket
import fcntl
import os
import select
import struct
import sys
import time

# --- the protocol --------------------------------------------------------------------------------
# On the control socket (SOCK_SEQPACKET), provider -> starter: EXEC + the command's spec with three
# descriptors (the command's reply socket, its stdout and stderr pipes), or, for a spec over
# INLINE_SPEC bytes, EXEC alone with a fourth, a memfd holding the spec; the starter forwards it as it
# came to the command's init. Starter -> provider: READY once it serves. On a command's reply
# socket, provider -> starter: KILL (or the socket closed: the caller went away); starter ->
# provider: EXIT + the return code (int32), or FAIL + a UTF-8 message when the command could not be
# started.
READY, EXEC, KILL, EXIT, FAIL = b"r", b"x", b"k", b"e", b"f"
INLINE_SPEC = 1 << 14  # the largest spec sent inside the EXEC message (far under any socket buffer)
CODE = struct.Struct("=i")  # a return code, after EXIT
_MAX_FDS = 1 << 20

_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
_CLONE_NEWPID, _CLONE_NEWNET = 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE, _MS_SLAVE = 32, 4096, 16384, 1 << 18, 1 << 19
_PR_SET_DUMPABLE, _PR_CAPBSET_DROP = 4, 24
_PR_SET_CHILD_SUBREAPER, _PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 36, 47, 4
_CAPABILITY_VERSION_3 = 0x20080522
_SIOCSIFFLAGS, _IFF_UP = 0x8914, 0x1
_PROC_COVERS = ("sys", "sysrq-trigger", "irq", "bus")  # what bwrap's --proc makes read-only where writable
_INIT_FAILED = 126  # the exit code of a command init that could not set up (its message is on stderr)
_BACK_TO_BACK_S = 0.05  # a command this soon after the last one ended: commands come back to back
_NOT_STARTED = 127  # the exit code of a command that could not be executed (its message is on stderr)
_BASH: tuple[int, int] | None = None  # the bash (device, inode) a plain command may start without (argv)


def encode_spec(argv: list[str], env: dict[str, str], cwd: str) -> bytes:
    """A command for the starter: its cwd, argv and environment, NUL-separated (none holds a NUL)."""
    fields = [cwd, str(len(argv)), *argv, *(f"{name}={value}" for name, value in env.items())]
    return b"\0".join(os.fsencode(field) for field in fields)


def decode_spec(data: bytes) -> tuple[list[bytes], dict[bytes, bytes], bytes]:
    """The inverse of ``encode_spec``, as bytes (what ``execve`` takes); ValueError if malformed."""
    fields = data.split(b"\0")
    count = int(fields[1])
    if not 0 < count <= len(fields) - 2:
        raise ValueError("malformed command spec")
    argv = fields[2 : 2 + count]
    env = {}
    for entry in fields[2 + count :]:
        name, separator, value = entry.partition(b"=")
        if not separator or not name:
            raise ValueError("malformed environment entry")
        env[name] = value
    return argv, env, fields[0]


def returncode(status: int) -> int:
    """What the provider reports for a command init's wait status: its exit code, or -signal when it was
    killed (a timeout), as ``subprocess`` reports the bwrap process it used to start."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def command_status(status: int) -> int:
    """The exit code a command init exits with for its command's wait status: the command's exit code,
    or 128 + the signal that killed it (bwrap's convention)."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status) & 0xFF


# --- inside the sandbox --------------------------------------------------------------------------


class _Int(_ctypes._SimpleCData):  # type: ignore[type-arg]  # ctypes.c_int
    _type_ = "i"


class _Call(_ctypes.CFuncPtr):  # a libc function as ctypes.CDLL calls it
    _flags_ = _ctypes.FUNCFLAG_CDECL | _ctypes.FUNCFLAG_USE_ERRNO
    _restype_ = _Int


class _Libc:
    """The few system calls Python 3.9 has no wrapper for, through ``_ctypes`` alone (ints, bytes and
    None as arguments, an int back, ``errno`` kept), as ``ctypes.CDLL(None, use_errno=True)`` makes them."""

    def __init__(self) -> None:
        self._handle = _ctypes.dlopen(None, os.RTLD_NOW)  # type: ignore[arg-type]  # None: the program itself
        self._calls: dict[str, _Call] = {}

    def __getitem__(self, name: str) -> _Call:
        call = self._calls.get(name)
        if call is None:
            call = self._calls[name] = _Call((name, self))  # type: ignore[arg-type]  # any object with _handle
        return call

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            code = _ctypes.get_errno()
            raise OSError(code, f"{what}: {os.strerror(code)}")

    def unshare(self, flags: int) -> None:
        self._check(self["unshare"](flags), "unshare")

    def mount(self, source: bytes | None, target: bytes, fstype: bytes | None, flags: int) -> None:
        self._check(self["mount"](source, target, fstype, flags, None), f"mount {target!r}")

    def prctl(self, option: int, value: int, value2: int = 0) -> int:
        result: int = self["prctl"](option, value, value2, 0, 0)
        return result

    def drop_capabilities(self) -> None:
        """Empty every capability set: bounding first (that needs CAP_SETPCAP), ambient, then the rest."""
        with open("/proc/sys/kernel/cap_last_cap", "rb") as file:
            last = int(file.read())
        for cap in range(last + 1):
            self._check(self.prctl(_PR_CAPBSET_DROP, cap), f"drop capability {cap} from the bounding set")
        self._check(self.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL), "clear ambient capabilities")
        header = struct.pack("=Ii", _CAPABILITY_VERSION_3, 0)
        data = bytes(24)  # two zeroed __user_cap_data_struct: effective, permitted, inheritable (only read)
        self._check(self["capset"](header, data), "capset")
        self._check(self.prctl(_PR_SET_DUMPABLE, 0), "PR_SET_DUMPABLE")


def _keep_view_only(libc: _Libc) -> None:
    """In a command's new mount namespace (a slave of the starter's): every mount private but the
    sandbox's files (the starter's cwd, bwrap's ``--chdir``), which stay a slave of the provider's
    box/: a fork's or a snapshot's files the provider mounts there later reach the command too."""
    view = os.getcwdb()
    with open("/proc/self/mountinfo", "rb") as mountinfo:
        points = [line.split(b" ", 5)[4] for line in mountinfo]
    for escaped in dict.fromkeys(points):
        point = escaped.replace(b"\\040", b" ").replace(b"\\011", b"\t").replace(b"\\012", b"\n")
        if point != view:
            libc.mount(None, point.replace(b"\\134", b"\\"), None, _MS_PRIVATE)


def _close_fds_except(*keep: int) -> None:
    low = 3
    for fd in sorted(keep):
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, _MAX_FDS)


def rights(fds: list[int]) -> list[tuple[int, int, bytes]]:
    """The ancillary data that passes ``fds`` (SCM_RIGHTS)."""
    return [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, struct.pack(f"={len(fds)}i", *fds))]


def _send_fds(sock: _socket.socket, message: bytes, fds: list[int]) -> None:
    sock.sendmsg([message], rights(fds))


def _receive(sock: _socket.socket) -> tuple[bytes, list[int]]:
    """One message and the descriptors that came with it. A command (EXEC) comes with exactly its three
    descriptors and its spec, or its four (the spec in a memfd) and no spec; anything else with none
    (those that came are closed), and a truncated message as ``b"?"``. Each descriptor arrives
    close-on-exec (received descriptors are otherwise inheritable: none of them may reach a command)."""
    message, ancillary, flags, _address = sock.recvmsg(
        1 + INLINE_SPEC, _socket.CMSG_SPACE(4 * 4), _socket.MSG_CMSG_CLOEXEC
    )
    fds: list[int] = []
    for level, kind, data in ancillary:
        if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
            usable = len(data) - len(data) % 4
            fds += struct.unpack(f"={usable // 4}i", data[:usable])
    if flags & (_socket.MSG_TRUNC | _socket.MSG_CTRUNC):
        message = b"?" if message else message
    if not (message[:1] == EXEC and len(fds) == (3 if len(message) > 1 else 4)):
        for fd in fds:
            os.close(fd)
        fds = []
    return message, fds


def _reply_socket(fd: int) -> _socket.socket:
    """A command's reply socket, received from the provider, which makes it a SOCK_SEQPACKET pair: said
    here, not asked of the kernel (three system calls on the way to the command's start)."""
    return _socket.socket(_socket.AF_UNIX, _socket.SOCK_SEQPACKET, 0, fd)


def _say(fd: int, text: str) -> None:
    try:  # noqa: SIM105  (no contextlib: the starter imports C modules only)
        os.write(fd, f"sandbox starter: {text}\n".encode(errors="replace"))
    except OSError:
        pass


def _kill(pid: int) -> None:
    try:  # noqa: SIM105
        os.kill(pid, _signal.SIGKILL)
    except ProcessLookupError:
        pass


class _Spare:
    """A command init made ahead: PID 1 of fresh namespaces, without capabilities, waiting for a command."""

    def __init__(self, pid: int, pidfd: int, sock: _socket.socket) -> None:
        self.pid, self.pidfd, self.sock = pid, pidfd, sock


class _Command:
    def __init__(self, pid: int, pidfd: int, reply: _socket.socket) -> None:
        self.pid, self.pidfd, self.reply = pid, pidfd, reply
        self.killed = False


class Starter:
    """The starter's loop: commands from the control socket, kills from their reply sockets, exits from pidfds."""

    def __init__(self, control: _socket.socket, oom_score_adj: int) -> None:
        self._libc = _Libc()
        self._oom_score_adj = oom_score_adj
        self._control = control
        self._poll = select.poll()
        self._spare: _Spare | None = None
        self._by_pidfd: dict[int, _Command] = {}
        self._by_reply: dict[int, _Command] = {}
        self._ended = 0.0  # time.monotonic() when the last command ended
        self._eager = False  # whether commands come back to back (the next init is made at once)

    def serve(self) -> None:
        self._libc.prctl(_PR_SET_CHILD_SUBREAPER, 1)  # a command init's parent exits at once: it is ours
        self._libc.prctl(_PR_SET_DUMPABLE, 0)  # no ptrace, no /proc/PID/fd, even for our own uid
        _signal.signal(_signal.SIGINT, _signal.SIG_DFL)  # an init with a handler could be signalled from inside
        self._control.setblocking(False)
        self._poll.register(self._control.fileno(), select.POLLIN)
        self._spare = self._prepare()  # before READY: a sandbox whose commands cannot start fails at create
        self._control.send(READY)
        while True:
            # The next command's init: after idle (a model's turn between commands, RL's way) made once
            # no command runs, not beside one that starts, whose answer would wait for the CPU it
            # takes; when commands come back to back, made while one runs, so the next finds it.
            if self._spare is None and (self._eager or not self._by_pidfd):
                try:
                    self._spare = self._prepare()
                except OSError as exc:  # the pids limit, say: tried again, and a command meanwhile fails
                    _say(2, str(exc))
            waiting = self._spare is not None or self._by_pidfd
            for fd, _mask in self._poll.poll(None if waiting else 50):
                if fd == self._control.fileno():
                    if not self._on_control():
                        os._exit(0)  # at once: bwrap's init then ends every process of the sandbox
                elif fd in self._by_pidfd:
                    self._on_exit(self._by_pidfd[fd])
                elif fd in self._by_reply:
                    self._on_reply(self._by_reply[fd])
                elif self._spare is not None and fd == self._spare.pidfd:  # it died waiting (OOM, say)
                    self._discard_spare()

    def _on_control(self) -> bool:
        try:
            message, fds = _receive(self._control)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not message:  # the provider closed the sandbox or went away
            return False
        if not fds:  # not a command
            return True
        reply = _reply_socket(fds[0])
        try:
            self._start(reply, message, fds)
        except OSError as exc:
            self._answer(reply, FAIL + str(exc).encode(errors="replace"))
            reply.close()
        finally:
            for fd in fds[1:]:
                os.close(fd)
        return True

    def _start(self, reply: _socket.socket, message: bytes, fds: list[int]) -> None:
        self._eager = bool(self._by_pidfd) or time.monotonic() - self._ended < _BACK_TO_BACK_S
        spare = self._spare if self._spare is not None else self._prepare()
        self._spare = None
        try:
            _send_fds(spare.sock, message, fds)
        except OSError:
            self._forget_spare(spare)
            raise
        spare.sock.close()
        reply.setblocking(False)
        command = _Command(spare.pid, spare.pidfd, reply)
        self._by_pidfd[spare.pidfd] = command  # its pidfd is polled already
        self._by_reply[reply.fileno()] = command
        self._poll.register(reply.fileno(), select.POLLIN)

    def _on_reply(self, command: _Command) -> None:
        """The provider asked for the command's death (KILL), or dropped its end: kill its init, hence
        every process of its namespace. The init is our unreaped child, so its pid is still its own."""
        try:
            command.reply.recv(16)
        except BlockingIOError:
            return
        except OSError:
            pass
        self._poll.unregister(command.reply.fileno())
        if not command.killed:
            command.killed = True
            _kill(command.pid)

    def _on_exit(self, command: _Command) -> None:
        """Reap a command init. It answered the provider itself when its command ended; this answers
        for one that could not (killed: a timeout, or it failed): the first answer is the one read."""
        _pid, status = os.waitpid(command.pid, os.WNOHANG)
        if _pid == 0:
            return
        self._ended = time.monotonic()
        self._poll.unregister(command.pidfd)
        os.close(command.pidfd)
        del self._by_pidfd[command.pidfd]
        self._answer(command.reply, EXIT + CODE.pack(returncode(status)))
        if not command.killed:
            self._poll.unregister(command.reply.fileno())
        del self._by_reply[command.reply.fileno()]
        command.reply.close()

    @staticmethod
    def _answer(reply: _socket.socket, message: bytes) -> None:
        try:
            reply.setblocking(True)
            reply.send(message)
        except OSError:  # the caller is gone; nothing to tell
            pass

    def _discard_spare(self) -> None:
        if self._spare is not None:
            spare, self._spare = self._spare, None
            self._forget_spare(spare)

    def _forget_spare(self, spare: _Spare) -> None:
        self._poll.unregister(spare.pidfd)
        _kill(spare.pid)
        os.waitpid(spare.pid, 0)
        os.close(spare.pidfd)
        spare.sock.close()

    def _prepare(self) -> _Spare:
        """Fork a child that unshares the namespaces and forks the command init (so the init is PID 1
        there), then exits: the init, reparented to us (a subreaper), waits for its command."""
        ours, theirs = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_SEQPACKET)
        try:
            middle = os.fork()
            if middle == 0:
                self._middle(theirs)
        finally:
            theirs.close()
        try:
            os.waitpid(middle, 0)
            data = ours.recv(CODE.size)
            if len(data) != CODE.size:
                raise OSError("a command init could not be made (its error is on the starter's stderr)")
            pid = CODE.unpack(data)[0]
        except BaseException:
            ours.close()
            raise
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # out of descriptors: that init must not linger
            os.kill(pid, _signal.SIGKILL)
            os.waitpid(pid, 0)
            ours.close()
            raise
        spare = _Spare(pid, pidfd, ours)
        self._poll.register(pidfd, select.POLLIN)
        return spare

    def _middle(self, sock: _socket.socket) -> None:
        try:
            _close_fds_except(sock.fileno())
            self._libc.unshare(_CLONE_NEWPID | _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWIPC | _CLONE_NEWUTS)
            self._libc.mount(None, b"/", None, _MS_REC | _MS_SLAVE)  # nothing mounted here reaches the starter
            _keep_view_only(self._libc)
            init = os.fork()
            if init:
                sock.send(CODE.pack(init))
                os._exit(0)
            self._init(sock)
        except BaseException as exc:
            _say(2, f"cannot make a command init: {exc}")
        os._exit(_INIT_FAILED)

    def _init(self, sock: _socket.socket) -> None:
        """PID 1 of a command's namespaces: set them up, drop every capability, wait for the command."""
        libc = self._libc
        libc.mount(b"proc", b"/proc", b"proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        for name in _PROC_COVERS:
            path = b"/proc/" + name.encode()
            if os.access(path, os.W_OK):  # as bwrap: only what this uid could write (it owns none of it)
                libc.mount(path, path, None, _MS_BIND | _MS_REC)
                libc.mount(path, path, None, _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
        with open("/proc/self/oom_score_adj", "w") as file:  # above the starter's: a command dies first
            file.write(str(self._oom_score_adj))
        loopback = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
        try:
            fcntl.ioctl(loopback.fileno(), _SIOCSIFFLAGS, struct.pack("16sh22x", b"lo", _IFF_UP))
        finally:
            loopback.close()
        libc.drop_capabilities()
        message, fds = _receive(sock)
        if not fds:
            os._exit(_INIT_FAILED)
        sock.close()
        reply_fd, out, err = fds[:3]
        reply = _reply_socket(reply_fd)
        spec = message[1:]
        if len(fds) == 4:  # a spec too large for the message: in a memfd
            chunks = []
            while True:
                chunk = os.read(fds[3], 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
            os.close(fds[3])
            spec = b"".join(chunks)
        argv, env, cwd = decode_spec(spec)
        try:
            command = _spawn(argv, env, cwd, out, err)
        except OSError as exc:
            _say(err, f"cannot run {os.fsdecode(argv[0])!r} in {os.fsdecode(cwd)!r}: {exc.strerror or exc}")
            Starter._answer(reply, EXIT + CODE.pack(_NOT_STARTED))
            os._exit(_NOT_STARTED)
        os.close(out)
        os.close(err)
        while True:  # reap what the command leaves to us, until the command itself ends
            pid, status = os.wait()
            if pid == command:
                # Answer first: the starter is not woken on the way. Our exit then kills the rest.
                Starter._answer(reply, EXIT + CODE.pack(command_status(status)))
                os._exit(command_status(status))


def _spawn(argv: list[bytes], env: dict[bytes, bytes], cwd: bytes, out: int, err: int) -> int:
    """Start the command (vfork and exec, no copy of this process): its own session, stdin /dev/null,
    the provider's pipes, its cwd and environment, the signal dispositions Python changed reset. A plain
    ``bash -c`` command starts as bash would exec it (``direct_command``); when that exec fails, bash
    runs the command after all, and says what went wrong as it always did."""
    os.chdir(cwd)  # ours, which the command inherits: this process is about to be its init, nothing else
    file_actions = [
        (os.POSIX_SPAWN_OPEN, 0, "/dev/null", os.O_RDONLY, 0),
        (os.POSIX_SPAWN_DUP2, out, 1),
        (os.POSIX_SPAWN_DUP2, err, 2),
    ]
    defaults = (_signal.SIGPIPE, _signal.SIGXFSZ, _signal.SIGINT)
    direct = direct_command(argv, env, _BASH)
    if direct is not None:
        try:
            return os.posix_spawn(*direct, file_actions=file_actions, setsid=True, setsigdef=defaults)
        except OSError:  # not started (out of memory, E2BIG, a foreign binary): bash's turn
            pass
    path = _which(argv[0], env.get(b"PATH", b""))
    return os.posix_spawn(path, argv, env, file_actions=file_actions, setsid=True, setsigdef=defaults)


def _which(name: bytes, path: bytes) -> bytes:
    """``name`` looked up in ``path`` as ``execvp`` does (a name with a slash is taken as it is)."""
    if b"/" in name:
        return name
    for directory in path.split(b":"):
        candidate = os.path.join(directory or b".", name)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(2, f"{os.fsdecode(name)} not found in PATH")


# --- the fast path: a plain `bash -c` command started as bash would start it ------------------------------
# bash, given one simple command, finds its program in PATH and execs it in its own place, with the
# environment it exported: so does the init, without bash's start (about 0.7 ms, a third of an exec),
# for a command of plain words whose first word is no bash keyword or builtin, under an environment
# bash passes on as it came. Anything else (quoting, expansion, redirection, separators, globs,
# assignments, builtins, a program not found, a script bash would read itself, bash's own variables)
# goes to bash, as before. The starter is told which bash it may stand in for (its device and inode,
# checked by the provider against the real bash's exported environment, ``bash_environment``).
_NAME_CHARS = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_"
_PLAIN = _NAME_CHARS + b"-./,:+=@%^ "
_BASH_WORDS = frozenset(
    b"if then else elif fi case esac for select while until do done in function time { } ! [[ ]] coproc . : [ "
    b"alias bg bind break builtin caller cd command compgen complete compopt continue declare dirs disown echo "
    b"enable eval exec exit export false fc fg getopts hash help history jobs kill let local logout mapfile popd "
    b"printf pushd pwd read readarray readonly return set shift shopt source suspend test times trap true type "
    b"typeset ulimit umask unalias unset wait".split()
)
# Builtins whose effect without arguments is their exit status alone: the system's program does the same.
_STATUS_BUILTINS = {
    b"true": (b"/usr/bin/true", b"/bin/true"),
    b"false": (b"/usr/bin/false", b"/bin/false"),
}
# Variables bash reads, sets, drops or rewrites when it starts (bash(1), "Shell Variables"), beside every
# name that begins with BASH, COMP_, HIST or READLINE_: an environment with one of them goes to bash.
_BASH_VARIABLES = frozenset(
    b"_ CDPATH CHILD_MAX COLUMNS COMPREPLY COPROC DIRSTACK EMACS ENV EPOCHREALTIME EPOCHSECONDS EUID EXECIGNORE "
    b"FCEDIT FIGNORE FUNCNAME FUNCNEST GLOBIGNORE GROUPS HOSTFILE HOSTNAME HOSTTYPE IFS IGNOREEOF INPUTRC "
    b"INSIDE_EMACS LINENO LINES MACHTYPE MAIL MAILCHECK MAILPATH MAPFILE OLDPWD OPTARG OPTERR OPTIND OSTYPE "
    b"PIPESTATUS POSIXLY_CORRECT PPID PROMPT_COMMAND PROMPT_DIRTRIM PS0 PS1 PS2 PS3 PS4 PWD RANDOM REPLY SECONDS "
    b"SHELLOPTS SHLVL SRANDOM TEXTDOMAIN TEXTDOMAINDIR TIMEFORMAT TMOUT UID auto_resume histchars".split()
)
_BASH_PREFIXES = (b"BASH", b"COMP_", b"HIST", b"READLINE_")
_QUIET_LC_ALL = (b"C", b"POSIX")  # any other LC_ALL may make bash warn that it cannot set the locale
_VARIABLE_BUCKETS = 1024  # bash's variable table: FNV-1 hashes, each bucket newest first
_S_IFMT, _S_IFREG, _S_IFDIR = 0o170000, 0o100000, 0o040000


def direct_command(
    argv: list[bytes], env: dict[bytes, bytes], bash: tuple[int, int] | None
) -> tuple[bytes, list[bytes], dict[bytes, bytes]] | None:
    """What ``bash -c COMMAND`` (``argv``) would exec in this cwd, as (program, argv, environment), when
    COMMAND is plain words that bash would run so, the bash it names in PATH is ``bash`` (device, inode)
    and its environment passes through bash unchanged; None when bash has to run it."""
    if bash is None or len(argv) != 3 or argv[0] != b"bash" or argv[1] != b"-c" or argv[2].translate(None, _PLAIN):
        return None
    words = argv[2].split()
    if not words or b"=" in words[0]:  # nothing to run, or an assignment
        return None
    name = words[0]
    twins = _STATUS_BUILTINS.get(name)
    if (twins is None and name in _BASH_WORDS) or (twins is not None and len(words) > 1):
        return None
    for variable, value in env.items():
        if (
            variable[:1].isdigit()
            or variable.translate(None, _NAME_CHARS)
            or variable in _BASH_VARIABLES
            or variable.startswith(_BASH_PREFIXES)
            or (variable == b"LC_ALL" and value not in _QUIET_LC_ALL)
        ):
            return None
    path = env.get(b"PATH")
    if path is None or not _same_bash(path, bash):
        return None
    program = _bash_lookup(name, path)
    if program is None or (twins is not None and os.path.realpath(program) not in twins):
        return None
    return program, words, bash_environment(env, os.getcwdb(), program)


def bash_environment(env: dict[bytes, bytes], pwd: bytes, program: bytes) -> dict[bytes, bytes]:
    """The environment bash 5 execs a program with, given its own (none of bash's variables in it): in
    its variable table's order (the names in ``env``, then ``PWD`` and ``SHLVL``, which bash adds; each
    bucket newest first), ``PWD`` the physical cwd (``pwd``), ``SHLVL`` 0 (bash counts itself out when it
    execs in its own place), then ``_``, the program."""
    entries = [*env.items(), (b"PWD", pwd), (b"SHLVL", b"0")]
    order = sorted(range(len(entries)), key=lambda index: (_bucket(entries[index][0]), -index))
    exported = dict(entries[index] for index in order)
    exported[b"_"] = program
    return exported


def _bucket(name: bytes) -> int:
    value = 2166136261
    for byte in name:
        value = (value * 16777619) & 0xFFFFFFFF
        value ^= byte
    return value & (_VARIABLE_BUCKETS - 1)


def _same_bash(path: bytes, bash: tuple[int, int]) -> bool:
    """Whether the ``bash`` that PATH names (as the shell path looks it up) is the one given."""
    try:
        info = os.stat(_which(b"bash", path))
    except OSError:
        return False
    return (info.st_dev, info.st_ino) == bash


def _bash_lookup(name: bytes, path: bytes) -> bytes | None:
    """The program bash would exec for ``name``: a name with a slash as it is, else the first executable
    non-directory in PATH (whose directories must be absolute here), named as bash names it; None when
    bash would not find one, or would read the file as a script itself, or may (``_runs_as_program``)."""
    if b"/" in name:
        candidates = [name]
    else:
        directories = path.split(b":")
        if not all(directory[:1] == b"/" for directory in directories):
            return None
        candidates = [directory + (b"" if directory[-1:] == b"/" else b"/") + name for directory in directories]
    for candidate in candidates:
        try:
            mode = os.stat(candidate).st_mode & _S_IFMT
        except OSError:
            continue
        if mode == _S_IFDIR or not os.access(candidate, os.X_OK):
            continue
        return candidate if mode == _S_IFREG and _runs_as_program(candidate) else None
    return None


def _runs_as_program(path: bytes, depth: int = 0) -> bool:
    """Whether ``path`` is an ELF program, or a ``#!`` script whose interpreter is one: what the kernel
    runs itself. A file the kernel refuses (ENOEXEC) bash reads as a script; that stays bash's."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        head = os.read(fd, 256) if os.fstat(fd).st_mode & _S_IFMT == _S_IFREG else b""  # no FIFO, no device
    except OSError:
        return False
    finally:
        os.close(fd)
    if head.startswith(b"\x7fELF"):
        return True
    if not head.startswith(b"#!") or depth or b"\n" not in head:
        return False
    interpreter = head[2 : head.index(b"\n")].split()
    return bool(interpreter) and interpreter[0][:1] == b"/" and _runs_as_program(interpreter[0], depth + 1)


def main() -> None:
    if sys.version_info < (3, 9):  # noqa: UP036  (the sandbox's Python, not this package's)
        _say(2, f"needs Python 3.9 or newer, not {sys.version.split()[0]} ({sys.executable})")
        sys.exit(_INIT_FAILED)
    global _BASH
    if sys.argv[3] != "-":  # the bash whose plain commands the init may start itself
        device, inode = sys.argv[3].split(":")
        _BASH = (int(device), int(inode))
    control = _socket.socket(fileno=int(sys.argv[1]))
    _close_fds_except(control.fileno())  # the script's memfd, and whatever bwrap left open
    Starter(control, int(sys.argv[2])).serve()


if __name__ == "__main__":
    main()
