/**
 * Charts of the soak benchmark, without dependencies: a block-character area chart for the
 * terminal and a hand-written SVG of several stacked panels sharing one time axis.
 */

export interface Point {
  /** Minutes since the start of the measured period. */
  readonly x: number
  readonly y: number
}

// ---------------------------------------------------------------------------------------------
// Numbers
// ---------------------------------------------------------------------------------------------

/** A compact label: 1234567 -> "1.23M", 850.5 -> "850.5", 0.123 -> "0.123". */
export const shortNumber = (v: number): string => {
  if (!Number.isFinite(v)) return String(v)
  const a = Math.abs(v)
  if (a >= 1e9) return `${trim((v / 1e9).toFixed(2))}G`
  if (a >= 1e6) return `${trim((v / 1e6).toFixed(2))}M`
  if (a >= 1e4) return `${trim((v / 1e3).toFixed(1))}k`
  if (a >= 100) return Math.round(v).toString()
  if (a >= 10) return trim(v.toFixed(1))
  if (a >= 1) return trim(v.toFixed(2))
  return trim(v.toPrecision(2))
}

const trim = (s: string): string => (s.includes(".") ? s.replace(/\.?0+$/, "") : s)

/** A "nice" step (1, 2 or 5 times a power of ten) near `raw`. */
export const niceStep = (raw: number): number => {
  if (!(raw > 0) || !Number.isFinite(raw)) return 1
  const p = Math.pow(10, Math.floor(Math.log10(raw)))
  const f = raw / p
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p
}

/**
 * The y range of a chart: the data's min..max, widened to at least `minSpanFraction` of the
 * largest magnitude (so that noise of a few kB does not look like a cliff), never below 0 for
 * data that is not negative.
 */
const yRange = (ys: ReadonlyArray<number>, minSpanFraction: number): { lo: number; hi: number } => {
  const finite = ys.filter(Number.isFinite)
  if (finite.length === 0) return { lo: 0, hi: 1 }
  let lo = Math.min(...finite)
  let hi = Math.max(...finite)
  const minSpan = Math.max(Math.abs(hi), Math.abs(lo)) * minSpanFraction || 1
  if (hi - lo < minSpan) {
    const mid = (hi + lo) / 2
    lo = mid - minSpan / 2
    hi = mid + minSpan / 2
  }
  if (lo < 0 && Math.min(...finite) >= 0) {
    hi -= lo
    lo = 0
  }
  return { lo, hi }
}

/** Least-squares slope of y over x (per x unit), NaN with fewer than 2 distinct x. */
export const slope = (points: ReadonlyArray<Point>): number => {
  const pts = points.filter((p) => Number.isFinite(p.y))
  if (pts.length < 2) return NaN
  const mx = pts.reduce((a, p) => a + p.x, 0) / pts.length
  const my = pts.reduce((a, p) => a + p.y, 0) / pts.length
  let num = 0
  let den = 0
  for (const p of pts) {
    num += (p.x - mx) * (p.y - my)
    den += (p.x - mx) * (p.x - mx)
  }
  return den === 0 ? NaN : num / den
}

// ---------------------------------------------------------------------------------------------
// Terminal
// ---------------------------------------------------------------------------------------------

const BLOCKS = [" ", "▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"] as const

export interface TerminalChartOptions {
  readonly title: string
  readonly width?: number
  readonly height?: number
  /** Formats the y labels (default shortNumber). */
  readonly format?: (v: number) => string
  /** The smallest y span shown, as a fraction of the largest value (default 0.05). */
  readonly minSpanFraction?: number
  /** How a column sums up the samples that fall in it (default max: a leak's peak shows). */
  readonly reduce?: "max" | "mean"
}

/**
 * An area chart of `points` (sorted by x) in `width` x `height` character cells, 8 levels per
 * cell, with the y range on the left and minutes below. Returns the lines joined by "\n".
 */
export const terminalChart = (points: ReadonlyArray<Point>, options: TerminalChartOptions): string => {
  const width = options.width ?? 60
  const height = options.height ?? 12
  const format = options.format ?? shortNumber
  const pts = points.filter((p) => Number.isFinite(p.y))
  if (pts.length === 0) return `${options.title}\n  (no samples)`
  const x0 = pts[0]!.x
  const x1 = Math.max(pts[pts.length - 1]!.x, x0 + 1e-9)
  // One value per column: the samples inside it, or the nearest sample when there are fewer
  // samples than columns.
  const columns: Array<number> = []
  let j = 0
  for (let k = 0; k < width; k++) {
    const a = x0 + ((x1 - x0) * k) / width
    const b = x0 + ((x1 - x0) * (k + 1)) / width
    const inside: Array<number> = []
    while (j < pts.length && (pts[j]!.x < b || (k === width - 1 && pts[j]!.x <= b))) {
      if (pts[j]!.x >= a) inside.push(pts[j]!.y)
      j++
    }
    if (inside.length > 0) {
      columns.push(options.reduce === "mean" ? inside.reduce((s, v) => s + v, 0) / inside.length : Math.max(...inside))
    } else {
      const mid = (a + b) / 2
      let best = pts[0]!
      for (const p of pts) if (Math.abs(p.x - mid) < Math.abs(best.x - mid)) best = p
      columns.push(best.y)
    }
  }
  const { lo: dataLo, hi } = yRange(columns, options.minSpanFraction ?? 0.05)
  // Leave the lowest value a sliver of height so that every column is visible.
  const lo = Math.max(dataLo - (hi - dataLo) * 0.06, Math.min(...columns) >= 0 ? 0 : -Infinity)
  const levels = height * 8
  const heights = columns.map((v) => Math.max(1, Math.round(((v - lo) / (hi - lo)) * levels)))
  const labels = new Map<number, string>([
    [0, format(hi)],
    [Math.floor((height - 1) / 2), format((hi + lo) / 2)],
    [height - 1, format(lo + (hi - lo) / height)]
  ])
  const labelWidth = Math.max(...[...labels.values()].map((l) => l.length))
  const out: Array<string> = [options.title]
  for (let r = 0; r < height; r++) {
    const base = (height - 1 - r) * 8
    let row = ""
    for (const h of heights) row += BLOCKS[Math.min(8, Math.max(0, h - base))]
    const label = labels.get(r) ?? ""
    out.push(`${label.padStart(labelWidth)} ┤${row}`)
  }
  out.push(`${" ".repeat(labelWidth)} └${"─".repeat(width)}`)
  const span = x1 - x0
  const digits = span >= 20 ? 0 : span >= 2 ? 1 : 2
  const left = x0.toFixed(digits)
  const middle = ((x0 + x1) / 2).toFixed(digits)
  const right = `${x1.toFixed(digits)} min`
  const axis = Array.from({ length: width + 2 }, () => " ")
  const put = (at: number, s: string) => {
    for (let i = 0; i < s.length && at + i < axis.length; i++) axis[Math.max(0, at + i)] = s[i]!
  }
  put(1, left)
  put(Math.round(width / 2) + 1 - Math.floor(middle.length / 2), middle)
  put(width + 2 - right.length, right)
  out.push(`${" ".repeat(labelWidth)}${axis.join("")}`)
  return out.join("\n")
}

// ---------------------------------------------------------------------------------------------
// SVG
// ---------------------------------------------------------------------------------------------

export interface Series {
  readonly name: string
  readonly color: string
  readonly points: ReadonlyArray<Point>
  /** Dashed line. */
  readonly dashed?: boolean
}

export interface Panel {
  readonly title: string
  readonly series: ReadonlyArray<Series>
  /** Start the y axis at 0 (default: fit the data, as the terminal chart does). */
  readonly fromZero?: boolean
}

const escapeXml = (s: string): string =>
  s.replace(/&/g, "&amp;").replace(/</g, "&lt;").replace(/>/g, "&gt;").replace(/"/g, "&quot;")

/** Stacked panels over one time axis (minutes), as a standalone SVG document. */
export const svgChart = (title: string, subtitle: string, panels: ReadonlyArray<Panel>): string => {
  const W = 960
  const panelH = 170
  const gap = 46
  const left = 78
  const right = 170
  const top = 84
  const plotW = W - left - right
  const H = top + panels.length * (panelH + gap) + 10
  const all = panels.flatMap((p) => p.series.flatMap((s) => s.points))
  const x0 = all.length > 0 ? Math.min(...all.map((p) => p.x)) : 0
  const x1 = all.length > 0 ? Math.max(...all.map((p) => p.x), x0 + 1e-9) : 1
  const xStep = niceStep((x1 - x0) / 8)
  const sx = (x: number) => left + ((x - x0) / (x1 - x0)) * plotW
  const out: Array<string> = []
  out.push(`<svg xmlns="http://www.w3.org/2000/svg" width="${W}" height="${H}" viewBox="0 0 ${W} ${H}" font-family="sans-serif" font-size="12">`)
  out.push(`<rect width="${W}" height="${H}" fill="#ffffff"/>`)
  out.push(`<text x="${left}" y="24" font-size="16" font-weight="bold">${escapeXml(title)}</text>`)
  out.push(`<text x="${left}" y="44" fill="#555">${escapeXml(subtitle)}</text>`)
  panels.forEach((panel, i) => {
    const y0 = top + i * (panelH + gap)
    const ys = panel.series.flatMap((s) => s.points.map((p) => p.y)).filter(Number.isFinite)
    let { lo, hi } = yRange(ys, 0.05)
    if (panel.fromZero === true) lo = Math.min(0, lo)
    const yStep = niceStep((hi - lo) / 5)
    lo = Math.floor(lo / yStep) * yStep
    hi = Math.max(Math.ceil(hi / yStep) * yStep, lo + yStep)
    const sy = (y: number) => y0 + panelH - ((y - lo) / (hi - lo)) * panelH
    out.push(`<text x="${left}" y="${y0 - 8}" font-weight="bold">${escapeXml(panel.title)}</text>`)
    out.push(`<rect x="${left}" y="${y0}" width="${plotW}" height="${panelH}" fill="none" stroke="#999"/>`)
    for (let v = lo; v <= hi + yStep / 1000; v += yStep) {
      const y = sy(v).toFixed(1)
      out.push(`<line x1="${left}" x2="${left + plotW}" y1="${y}" y2="${y}" stroke="#e4e4e4"/>`)
      out.push(`<text x="${left - 6}" y="${y}" text-anchor="end" dominant-baseline="middle" fill="#444">${escapeXml(shortNumber(v))}</text>`)
    }
    for (let v = Math.ceil(x0 / xStep) * xStep; v <= x1 + xStep / 1000; v += xStep) {
      const x = sx(v).toFixed(1)
      out.push(`<line x1="${x}" x2="${x}" y1="${y0}" y2="${y0 + panelH}" stroke="#eeeeee"/>`)
      out.push(`<text x="${x}" y="${y0 + panelH + 15}" text-anchor="middle" fill="#444">${escapeXml(shortNumber(v))}</text>`)
    }
    out.push(`<text x="${left + plotW}" y="${y0 + panelH + 30}" text-anchor="end" fill="#444">minutes</text>`)
    panel.series.forEach((s, k) => {
      const pts = s.points.filter((p) => Number.isFinite(p.y))
      if (pts.length > 0) {
        const d = pts.map((p) => `${sx(p.x).toFixed(1)},${sy(p.y).toFixed(1)}`).join(" ")
        out.push(
          `<polyline points="${d}" fill="none" stroke="${s.color}" stroke-width="1.6"${s.dashed === true ? ' stroke-dasharray="5,3"' : ""}/>`
        )
      }
      const ly = y0 + 14 + k * 18
      out.push(`<line x1="${left + plotW + 12}" x2="${left + plotW + 32}" y1="${ly}" y2="${ly}" stroke="${s.color}" stroke-width="2"${s.dashed === true ? ' stroke-dasharray="5,3"' : ""}/>`)
      out.push(`<text x="${left + plotW + 38}" y="${ly}" dominant-baseline="middle">${escapeXml(s.name)}</text>`)
    })
  })
  out.push(`</svg>`)
  return out.join("\n") + "\n"
}
