/**
 * vitest's global setup: one private PostgreSQL for the run when none is given, so that a plain
 * `npm test` runs the PostgreSQL suites on a machine with the PostgreSQL binaries.
 * `AGENTD_TEST_PG_URL` set (as `.ci/run` does): that server is used and nothing is started.
 * `AGENTD_TEST_PG=0`: none is started (the PostgreSQL suites then skip, or fail under CI=true).
 */
import { spawnSync } from "node:child_process"
import * as fs from "node:fs"
import * as os from "node:os"
import * as path from "node:path"
import { fileURLToPath } from "node:url"
import type { TestProject } from "vitest/node"

const script = path.join(path.dirname(fileURLToPath(import.meta.url)), "..", "..", "scripts", "pg-test-server.sh")

export default function setup(project: TestProject) {
  const given = process.env["AGENTD_TEST_PG_URL"]
  if (given !== undefined && given !== "") {
    project.provide("agentdTestPgUrl", given)
    project.provide("agentdTestPgWhy", undefined)
    return
  }
  if (process.env["AGENTD_TEST_PG"] === "0") {
    project.provide("agentdTestPgUrl", undefined)
    project.provide("agentdTestPgWhy", "AGENTD_TEST_PG=0")
    return
  }
  const base = fs.mkdtempSync(path.join(os.tmpdir(), "agentd-pg-"))
  const dir = path.join(base, "pg")
  const started = spawnSync("bash", [script, "start", dir], { encoding: "utf8" })
  if (started.status !== 0) {
    fs.rmSync(base, { recursive: true, force: true })
    const why = started.status === 3
      ? "no PostgreSQL binaries on this machine (initdb, pg_ctl, postgres)"
      : `the private PostgreSQL did not start: ${(started.stderr || String(started.error ?? "")).trim().split("\n").slice(-3).join(" ")}`
    project.provide("agentdTestPgUrl", undefined)
    project.provide("agentdTestPgWhy", why)
    return
  }
  project.provide("agentdTestPgUrl", started.stdout.trim())
  project.provide("agentdTestPgWhy", undefined)
  return () => {
    spawnSync("bash", [script, "stop", dir], { encoding: "utf8" })
    fs.rmSync(base, { recursive: true, force: true })
  }
}
