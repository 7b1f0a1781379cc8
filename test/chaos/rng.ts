/**
 * The seeded random source of a chaos run: every random choice of a run (configuration, load,
 * fault kinds, fault moments, client behaviour) is drawn from one of these, so a seed names a
 * run. Real processes make the timing differ between two runs of a seed; the choices do not.
 */
export class Rng {
  private state: number

  constructor(readonly seed: number) {
    this.state = seed >>> 0
  }

  /** mulberry32: a float in [0, 1). */
  next(): number {
    this.state = (this.state + 0x6d2b79f5) >>> 0
    let t = this.state
    t = Math.imul(t ^ (t >>> 15), t | 1)
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61)
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296
  }

  /** An integer in [min, max], both included. */
  int(min: number, max: number): number {
    return min + Math.floor(this.next() * (max - min + 1))
  }

  chance(p: number): boolean {
    return this.next() < p
  }

  pick<A>(items: ReadonlyArray<A>): A {
    if (items.length === 0) throw new Error("Rng.pick: no items")
    return items[Math.floor(this.next() * items.length)]!
  }

  /** A key of `weights`, with probability proportional to its weight. */
  weighted<K extends string>(weights: Readonly<Record<K, number>>): K {
    const entries = Object.entries(weights) as Array<[K, number]>
    const total = entries.reduce((a, [, w]) => a + w, 0)
    let r = this.next() * total
    for (const [k, w] of entries) {
      r -= w
      if (r < 0) return k
    }
    return entries[entries.length - 1]![0]
  }

  /** An exponentially distributed delay with this mean (ms). */
  exp(meanMs: number): number {
    return -Math.log(1 - this.next()) * meanMs
  }

  /** A new independent source, drawn from this one (one per client, per driver...). */
  fork(): Rng {
    return new Rng(Math.floor(this.next() * 4294967296))
  }
}
