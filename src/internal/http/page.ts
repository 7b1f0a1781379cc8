/**
 * The web page's files (built from web/ by `npm run build` into dist/src/web/, shipped in the
 * package): read once at start and served from memory at `/`, `/app.js` and `/app.css`. The
 * directory is found beside the module that loads this one: dist/src/ for the compiled modules,
 * dist/src/bin/ for the daemon's bundle, hence both `web/` and `../web/`. No CDN, no network.
 */
import * as fs from "../fileIoSync.js"
import { fileURLToPath } from "node:url"

export interface PageFile {
  readonly body: Uint8Array
  readonly contentType: string
}

const FILES: Readonly<Record<string, readonly [string, string]>> = {
  "/": ["index.html", "text/html; charset=utf-8"],
  "/app.js": ["app.js", "text/javascript; charset=utf-8"],
  "/app.css": ["app.css", "text/css; charset=utf-8"]
}

/**
 * The page's headers: its scripts and styles only from here, no inline script, no frame, no
 * request elsewhere.
 */
export const PAGE_HEADERS: Readonly<Record<string, string>> = {
  "cache-control": "no-store",
  "x-content-type-options": "nosniff",
  "x-frame-options": "DENY",
  "referrer-policy": "no-referrer",
  "content-security-policy":
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
}

/** The page's files by path, or why they are missing (a source checkout that was not built). */
export const loadPage = (): ReadonlyMap<string, PageFile> | string => {
  const dirs = ["web/", "../web/"].map((rel) => fileURLToPath(new URL(rel, import.meta.url)))
  const dir = dirs.find((d) => fs.existsSync(`${d}index.html`) && fs.existsSync(`${d}app.js`))
  if (dir === undefined) return `The web page is not built (looked in ${dirs.join(", ")}): run \`npm run build\`.`
  const files = new Map<string, PageFile>()
  for (const [route, [file, contentType]] of Object.entries(FILES)) {
    files.set(route, { body: fs.readFileSync(`${dir}${file}`), contentType })
  }
  return files
}
