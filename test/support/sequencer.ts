/**
 * vitest's file order: the longest files first.
 *
 * Two forks take files from one queue. vitest orders it by the durations of the last run in
 * this checkout (its cache); a fresh clone, as CI runs, has none, and the queue is then in glob
 * order, which put the one-minute chaos run last: one fork ran it alone for ~45 s while the
 * other sat idle. Longest first (the LPT rule) keeps both forks busy until the short files
 * even out the end.
 *
 * Where vitest's cache knows every file (a checkout that ran the suite before) it knows better:
 * its order is kept. Otherwise the files of `SLOW` go first, longest first, then the others in
 * vitest's order. The list only orders files (a stale entry costs a less even end, never a
 * test), so it is kept small: the files over ~10 s on a loaded 2-core machine.
 */
import * as path from "node:path"
import { BaseSequencer, type TestSpecification } from "vitest/node"

/** Seconds per file in a CI run (2 forks, a loaded 2-core machine), rounded; estimates for files changed since. */
export const SLOW: Readonly<Record<string, number>> = {
  "test/e2e/cli.test.ts": 90,
  "test/e2e/wedges.test.ts": 50,
  "test/chaos/smoke.test.ts": 47,
  "test/e2e/stopping.test.ts": 38,
  "test/e2e/server.test.ts": 36,
  "test/EventLog.test.ts": 35,
  "test/e2e/modelEngines.test.ts": 31,
  "test/e2e/events.test.ts": 30,
  "test/e2e/recovery.test.ts": 29,
  "test/e2e/snapshot.test.ts": 28,
  "test/e2e/webPage.test.ts": 28,
  "test/e2e/shutdown.test.ts": 26,
  "test/e2e/httpStreams.test.ts": 23,
  "test/e2e/storage.test.ts": 23,
  "test/e2e/stateDirLock.test.ts": 22,
  "test/e2e/workers.test.ts": 22,
  "test/e2e/lifecycle.test.ts": 20,
  "test/e2e/httpEvents.test.ts": 19,
  "test/e2e/baseline.test.ts": 17,
  "test/e2e/examples.test.ts": 15,
  "test/e2e/attachInteractive.test.ts": 15,
  "test/WorkerPool.test.ts": 15,
  "test/e2e/httpSecurity.test.ts": 14,
  "test/StateDirLock.test.ts": 12,
  "test/RecoveryJournal.test.ts": 12,
  "test/e2e/sessionClient.test.ts": 12,
  "test/e2e/damaged.test.ts": 12,
  "test/e2e/httpClients.test.ts": 12,
  "test/e2e/seedScenarios.test.ts": 11,
  "test/e2e/conformance.test.ts": 10,
  "test/e2e/oversize.test.ts": 10
}

export default class LongestFirst extends BaseSequencer {
  override async sort(files: Array<TestSpecification>): Promise<Array<TestSpecification>> {
    const root = this.ctx.config.root
    const rel = (f: TestSpecification) => path.relative(root, f.moduleId).split(path.sep).join("/")
    const cached = files.every((f) => this.ctx.cache.getFileTestResults(`${f.project.name}:${rel(f)}`) !== undefined)
    if (cached) return super.sort(files)
    // Array.prototype.sort is stable: unlisted files keep vitest's order among themselves.
    return [...files].sort((a, b) => (SLOW[rel(b)] ?? 0) - (SLOW[rel(a)] ?? 0))
  }
}
