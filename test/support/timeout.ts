/**
 * A promise bounded in time, for the e2e harness and the benchmarks (plain Node, no vitest, so
 * that the compiled benchmarks can use it too).
 */

/** `p`, or a rejection that says `what()` after `ms`. */
export const withTimeout = <A>(p: Promise<A>, ms: number, what: () => string): Promise<A> => {
  let timer: NodeJS.Timeout | undefined
  const timeout = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out after ${ms} ms: ${what()}`)), ms)
  })
  return Promise.race([p, timeout]).finally(() => clearTimeout(timer))
}
