/**
 * A setup file (run before each test file): the project's own modules start afresh for every
 * test file, as they would in a new process.
 *
 * The forks are reused across test files (`isolate: false` in vitest.config.ts): a new process
 * per file cost ~2.5 s of start-up (Node, vitest's worker, importing effect) on a loaded 2-core
 * machine, about 90 s of a suite of 73 files. Reusing the process keeps what node_modules
 * loaded (effect, vitest); resetting vitest's module registry here gives each file its own
 * instances of src/ and test/ modules (module-level state such as the e2e harness's daemon
 * registry), which is what a fresh process gave them.
 */
import { vi } from "vitest"

vi.resetModules()
