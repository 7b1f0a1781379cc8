/**
 * A real browser for the tests: Debian's `chromium`, headless, driven by `playwright-core` (no
 * browser download). One browser per test file (`useBrowser`), always closed after it, pass or
 * fail, with its temporary profile.
 *
 * Without a chromium the browser tests skip, saying why, except under `CI=true`, where they
 * fail: `.ci/run` installs chromium, so a missing one there is a broken CI machine, not a
 * reason to pass.
 */
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { type Browser, type BrowserContext, chromium, type Page } from "playwright-core"
import { afterAll, beforeAll, describe, it } from "vitest"

/** Where chromium is looked for (`AGENTD_CHROMIUM` first). */
const CANDIDATES = [process.env["AGENTD_CHROMIUM"], "/usr/bin/chromium", "/usr/bin/chromium-browser"]

/** The chromium to drive, or undefined when there is none. */
export const chromiumPath: string | undefined = CANDIDATES.find((p): p is string => p !== undefined && p !== "" && fs.existsSync(p))

const missingReason = `no chromium (looked at ${CANDIDATES.filter((p) => p !== undefined && p !== "").join(", ")}; \`apt-get install chromium\`, or set AGENTD_CHROMIUM)`

/**
 * Flags that keep a headless chromium quiet and self-contained on a machine without a network:
 * without the background-networking ones it keeps trying to reach Google's services.
 */
const FLAGS = [
  "--no-sandbox",
  "--disable-gpu",
  "--disable-quic",
  "--no-first-run",
  "--disable-background-networking",
  "--disable-component-update",
  "--disable-sync",
  "--disable-dev-shm-usage"
]

/** Launches chromium with a fresh profile; `close` ends it and removes the profile. */
export const launchBrowser = async (): Promise<{ readonly browser: BrowserContext; readonly close: () => Promise<void> }> => {
  if (chromiumPath === undefined) throw new Error(missingReason)
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-chromium-"))
  let context: BrowserContext | undefined
  try {
    context = await chromium.launchPersistentContext(profile, {
      executablePath: chromiumPath,
      headless: true,
      args: FLAGS,
      chromiumSandbox: false,
      timeout: 30_000
    })
  } catch (e) {
    fs.rmSync(profile, { recursive: true, force: true })
    throw e
  }
  const ctx = context
  return {
    browser: ctx,
    close: async () => {
      try {
        await ctx.close()
      } finally {
        fs.rmSync(profile, { recursive: true, force: true })
      }
    }
  }
}

/**
 * A `describe` for browser tests: runs `body` when chromium is there; otherwise, under
 * `CI=true`, one failing test that says why, and elsewhere a skipped block named with the reason.
 */
export const describeBrowser = (name: string, body: () => void): void => {
  if (chromiumPath !== undefined) {
    describe(name, body)
  } else if (process.env["CI"] === "true") {
    describe(name, () => {
      it("has a browser to run in", () => {
        throw new Error(`CI=true and ${missingReason}: the browser tests must run in CI`)
      })
    })
  } else {
    describe.skip(`${name} (skipped: ${missingReason})`, body)
  }
}

/**
 * One browser for the tests of the enclosing describe: launched in beforeAll, closed in
 * afterAll. The getter gives a new page (in the shared profile, so cookies are shared).
 */
export const useBrowser = (): { readonly context: () => BrowserContext; readonly newPage: () => Promise<Page> } => {
  let launched: Awaited<ReturnType<typeof launchBrowser>> | undefined
  beforeAll(async () => {
    launched = await launchBrowser()
  }, 60_000)
  afterAll(async () => {
    await launched?.close()
  })
  const context = () => {
    if (launched === undefined) throw new Error("the browser did not start")
    return launched.browser
  }
  return { context, newPage: () => context().newPage() }
}

export type { Browser, BrowserContext, Page }
