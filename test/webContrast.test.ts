/**
 * The page's colours (web/app.css) keep text readable: every text colour against every
 * background it is drawn on has a WCAG contrast ratio of at least 4.5:1, in the light and the
 * dark scheme. Read from the stylesheet itself, so a new colour cannot slip below it.
 */
import * as fs from "node:fs"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import { assert, describe, it } from "vitest"

const css = fs.readFileSync(path.join(path.dirname(fileURLToPath(import.meta.url)), "..", "web", "app.css"), "utf8")

/** The custom properties of the first `:root { ... }` block after `from`. */
const palette = (from: number): Record<string, string> => {
  const start = css.indexOf(":root", from)
  const body = css.slice(css.indexOf("{", start) + 1, css.indexOf("}", start))
  return Object.fromEntries([...body.matchAll(/--([a-z-]+):\s*(#[0-9a-f]{6})/gi)].map((m) => [m[1]!, m[2]!.toLowerCase()]))
}

const luminance = (hex: string): number => {
  const [r, g, b] = [1, 3, 5].map((i) => {
    const c = parseInt(hex.slice(i, i + 2), 16) / 255
    return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4
  })
  return 0.2126 * r! + 0.7152 * g! + 0.0722 * b!
}

const contrast = (a: string, b: string): number => {
  const [hi, lo] = [luminance(a), luminance(b)].sort((x, y) => y - x)
  return (hi! + 0.05) / (lo! + 0.05)
}

/** Text colour -> the backgrounds it is drawn on (see the rules of web/app.css). */
const PAIRS: Record<string, ReadonlyArray<string>> = {
  fg: ["bg", "soft", "user", "warn-bg", "error-bg"],
  muted: ["bg", "soft", "user"],
  accent: ["bg", "soft"],
  warn: ["bg", "soft", "warn-bg"],
  error: ["bg", "soft", "error-bg"],
  ok: ["bg", "soft"]
}

describe("the page's colours", () => {
  it("the contrast ratio is computed as WCAG defines it", () => {
    assert.closeTo(contrast("#000000", "#ffffff"), 21, 1e-9)
    assert.closeTo(contrast("#777777", "#ffffff"), 4.48, 0.01)
  })

  for (const [scheme, at] of [["light", 0], ["dark", css.indexOf("prefers-color-scheme: dark")]] as const) {
    it(`${scheme} scheme: every text colour on its backgrounds is at least 4.5:1`, () => {
      assert.isAtLeast(at, 0, "the stylesheet has a dark scheme")
      const p = palette(at)
      const low: Array<string> = []
      for (const [text, backgrounds] of Object.entries(PAIRS)) {
        for (const bg of backgrounds) {
          assert.isDefined(p[text], `--${text} in the ${scheme} scheme`)
          assert.isDefined(p[bg], `--${bg} in the ${scheme} scheme`)
          const ratio = contrast(p[text]!, p[bg]!)
          if (ratio < 4.5) low.push(`--${text} ${p[text]} on --${bg} ${p[bg]}: ${ratio.toFixed(2)}:1`)
        }
      }
      assert.deepStrictEqual(low, [])
    })
  }
})
