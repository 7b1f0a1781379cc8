/**
 * Whether the daemon's event path is in use by a real session: the start's warm-up of that path
 * (internal/warmUpDaemon.ts) gives way to it. It is there to spare a first turn the compiling, so
 * it must never run inside one: a client that prompts within a second of the start would
 * otherwise pay for both.
 */

/** The ids of the warm-up's throwaway sessions begin so (a real session's id is `s-<uuid>`). */
export const WARM_UP_SESSION_PREFIX = "s-warm-up-"

/** Set once a real session's worker has sent frames: the warm-up then stops at its next chunk. */
let inUse = false

/** Says that a session's worker frames take the event path now (the warm-up's own do not count). */
export const realFramesArrived = (activeSessionId: string): void => {
  if (!activeSessionId.startsWith(WARM_UP_SESSION_PREFIX)) inUse = true
}

/** Whether a real session's frames have taken the event path since the start. */
export const eventPathInUse = (): boolean => inUse
