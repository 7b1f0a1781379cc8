/** How every benchmark prints a figure next to its same-run baseline. */
export interface Ratio {
  readonly what: string
  readonly unit: string
  readonly ours: number
  readonly baseline: number
  readonly baselineName: string
  /** The ratio ours / baseline the project aims for (higher is better). */
  readonly target?: number
}

const fmt = (n: number): string =>
  n >= 100 ? Math.round(n).toLocaleString("en-US") : n.toFixed(n >= 10 ? 1 : 2)

export const printRatio = (r: Ratio): void => {
  const ratio = r.ours / r.baseline
  const verdict = r.target === undefined ? "" : ratio >= r.target ? `  (target >= ${r.target}x: met)` : `  (target >= ${r.target}x: MISSED)`
  console.log(
    `${r.what}: agentd ${fmt(r.ours)} ${r.unit} | baseline (${r.baselineName}) ${fmt(r.baseline)} ${r.unit} | ratio ${ratio.toFixed(2)}x${verdict}`
  )
}

/** Median and 95th percentile of a list of samples. */
export const percentiles = (samples: ReadonlyArray<number>): { median: number; p95: number } => {
  const sorted = [...samples].sort((a, b) => a - b)
  const at = (q: number) => sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))] ?? NaN
  return { median: at(0.5), p95: at(0.95) }
}
