/** Exit codes of the command line (docs/protocol.md section 8). No dependency: help uses them. */
export const EXIT = { ok: 0, failed: 1, usage: 2, unreachable: 3, interrupted: 130 } as const
