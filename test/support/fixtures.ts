/** Where the tests find the child programs that test/support/fixturesGlobalSetup.ts bundled. */
import * as path from "node:path"
import { inject } from "vitest"

declare module "vitest" {
  export interface ProvidedContext {
    agentdFixtureDir: string
  }
}

/** The bundled program of test/fixtures/<name>.ts. */
export const childProgram = (name: "eventLogChild" | "idleGcChild" | "journalChild" | "lockChild"): string =>
  path.join(inject("agentdFixtureDir"), `${name}.mjs`)
