import { defineConfig } from "vitest/config"
import LongestFirst from "./test/support/sequencer.js"

export default defineConfig({
  test: {
    include: ["test/**/*.test.ts"],
    // A private PostgreSQL for the store's suites when AGENTD_TEST_PG_URL names none; the
    // crash-test children bundled once.
    globalSetup: ["test/support/pgGlobalSetup.ts", "test/support/fixturesGlobalSetup.ts"],
    // End-to-end tests spawn real processes; two cores are the budget.
    pool: "forks",
    // A fork runs file after file (a new process per file cost ~2.5 s each on a loaded 2-core
    // machine); the setup file gives each file fresh instances of the project's modules.
    poolOptions: { forks: { maxForks: 2, minForks: 1, isolate: false } },
    setupFiles: ["test/support/freshModules.ts"],
    // Long files first, so that no fork idles at the end (test/support/sequencer.ts).
    sequence: { sequencer: LongestFirst },
    testTimeout: 60_000,
    hookTimeout: 60_000,
    // The JSON report is what .ci/run counts; the default reporter is for people.
    reporters: ["default", "json"],
    outputFile: { json: ".test-results/vitest.json" }
  }
})
