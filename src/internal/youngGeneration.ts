/**
 * The daemon's young generation, kept small. A turn's events are in flight in batches of several
 * MB (frames read from the worker, their log lines, the clients' writes), so most of what a
 * scavenge finds is alive and copied; the bigger the new space, the more of them each scavenge
 * copies and promotes, and the space is fresh memory as it grows (page faults). Measured
 * (bench/hotPath.ts, quiet machine, runs alternating with the build before): a session's first
 * turn cost the daemon 19-24 us of CPU per event with V8's default (semi-spaces of up to 16
 * MiB), 13.5-18.5 with this cap at 4 MiB; 1 MiB was worse (17.5-21), and 32-64 MiB made warm
 * turns dearer (14-15 us instead of 8-9).
 */
import { PerformanceObserver } from "node:perf_hooks"
import * as v8 from "node:v8"

/** The largest semi-space (MiB) of the daemon's young generation. */
export const DAEMON_SEMI_SPACE_MIB = 4

const givesSemiSpace = (args: ReadonlyArray<string>): boolean => args.some((a) => /semi[-_]space/.test(a))

/**
 * The Node flag that caps the young generation from a process's start, for where the daemon's
 * process is spawned (`serve --detach`): exact, where {@link capYoungGeneration} is best effort.
 * None when `execArgv` sets a semi-space size already.
 */
export const semiSpaceFlags = (execArgv: ReadonlyArray<string>): Array<string> =>
  givesSemiSpace(execArgv) ? [] : [`--max-semi-space-size=${DAEMON_SEMI_SPACE_MIB}`]

/**
 * Caps the process's semi-spaces at `mib`. `--max-semi-space-size` is read only when the
 * process starts, and the daemon is often started as `node .../agentd.js serve`; so the cap is
 * kept at run time: after each garbage collection, V8's growth factor for the new space (read
 * whenever it grows the space) is set to 1 once a semi-space has reached the cap, and back to 2
 * (V8's default) below it (V8 shrinks the space when little survives, and may grow it again).
 * Best effort: the factor is set after a collection, in a later task, so allocation that runs
 * through several scavenges without yielding (a burst of megabytes kept alive) can grow the space
 * past the cap, up to V8's own maximum, and nothing shrinks it back but V8 itself (the memory
 * reducer, when the process idles); the daemon's event path yields between batches, and its new
 * space stayed at the cap in the benchmark's runs (`--trace-gc-verbose`). A V8 that forces the
 * factor to at least 2 makes this a no-op. Does nothing when the process was given semi-space
 * flags itself (its command line or NODE_OPTIONS). Returns a function that stops it.
 */
export const capYoungGeneration = (mib: number): (() => void) => {
  if (givesSemiSpace([...process.execArgv, process.env["NODE_OPTIONS"] ?? ""])) return () => {}
  const cap = mib * 1024 * 1024
  let factor = 2
  const setFactor = (next: number) => {
    if (next === factor) return
    factor = next
    v8.setFlagsFromString(`--semi-space-growth-factor=${factor}`)
  }
  const observer = new PerformanceObserver(() => {
    const newSpace = v8.getHeapSpaceStatistics().find((space) => space.space_name === "new_space")
    // The new space is both semi-spaces.
    if (newSpace !== undefined) setFactor(newSpace.space_size / 2 >= cap ? 1 : 2)
  })
  observer.observe({ entryTypes: ["gc"] })
  return () => {
    observer.disconnect()
    setFactor(2)
  }
}
