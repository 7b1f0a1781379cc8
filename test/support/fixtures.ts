/** Where the tests find the child programs that test/support/fixturesGlobalSetup.ts bundled. */
import * as path from "node:path"
import { inject } from "vitest"

declare module "vitest" {
  export interface ProvidedContext {
    agentdFixtureDir: string
  }
}

/** The bundled program of test/fixtures/<name>.ts. */
export const childProgram = (
  name: "eventLogChild" | "eventLogPowerChild" | "idleGcChild" | "journalChild" | "lockChild" | "powerLossPreload"
): string =>
  path.join(inject("agentdFixtureDir"), `${name}.mjs`)
