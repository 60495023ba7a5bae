"""Bundle: locked wheelhouse per profile, SBOM, checksums and signature for the air gap."""
