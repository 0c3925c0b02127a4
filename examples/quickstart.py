"""Start a local sandbox through a two-layer stack and run a command in it."""

from typing import Any

import anyio

from sandbox_middleware import LocalProvider, Middleware, Operation, ProviderMiddleware, Sandbox, SandboxSpec, stack


class PrintCalls(ProviderMiddleware):
    """A tiny middleware: prints each operation on its way in and each command's exit code on the way out."""

    async def around(self, operation: Operation[Any]) -> Any:
        print(f"-> {operation.name}" + (f": {operation.command}" if operation.command is not None else ""))
        result = await operation()
        if operation.name == "exec":
            print(f"<- exit {result.return_code}")
        return result


async def main() -> None:
    provider = stack(LocalProvider(), [Middleware(PrintCalls), Middleware(ProviderMiddleware)])
    async with Sandbox(provider, SandboxSpec()) as sandbox:
        result = await sandbox.exec("echo hello from $(pwd)")
        print(result.stdout, end="")


if __name__ == "__main__":
    anyio.run(main)
